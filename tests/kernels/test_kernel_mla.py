"""Multi-head latent attention: the absorbed torch reference against attention over the expanded per-head K and V,
and the Triton kernels (latent write, decode with split contexts, packed prefill) against the reference.

Pools are built as the engine fills them: each sequence's latents scattered into shuffled blocks, every other slot
NaN and unused block-table entries pointing at an all-NaN block, so a kernel that reads what it should not gives
NaN."""

import itertools

import pytest
import torch

from kernels.fp8 import FP8_DTYPE
from kernels.mla_attention import (
    mla_attention_ref,
    mla_decode_triton,
    mla_prefill_triton,
    write_latent_cache_ref,
    write_latent_cache_triton,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def make_pool(seq_lens, latent_dim, rope_dim, block_size, dtype, device, seed=0, fp8=False):
    """(latent_cache, rope_cache, block_tables, per-sequence latents [n, L] and rope keys [n, R] as stored, and the
    FP8 scales or None)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    cache_dtype = FP8_DTYPE if fp8 else dtype
    latent_cache = torch.full((num_blocks, block_size, 1, latent_dim), float("nan")).to(cache_dtype)
    rope_cache = torch.full((num_blocks, block_size, 1, rope_dim), float("nan")).to(cache_dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poison = free.pop()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq, default=0) + 1), poison, dtype=torch.int32)
    latents, ropes = [], []
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        latent = torch.randn(n, latent_dim, generator=gen).to(cache_dtype)
        rope = (2 * torch.randn(n, rope_dim, generator=gen)).to(cache_dtype)
        blocks = [free.pop() for _ in range(nb)]
        block_tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        for j in range(n):
            latent_cache[blocks[j // block_size], j % block_size, 0] = latent[j]
            rope_cache[blocks[j // block_size], j % block_size, 0] = rope[j]
        latents.append(latent)
        ropes.append(rope)
    scales = (torch.tensor([0.5], device=device), torch.tensor([0.25], device=device)) if fp8 else (None, None)
    return latent_cache.to(device), rope_cache.to(device), block_tables.to(device), latents, ropes, scales


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def queries(num_tokens, num_heads, latent_dim, rope_dim, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(num_tokens, num_heads, latent_dim, generator=gen) / latent_dim ** 0.5
    q_pe = torch.randn(num_tokens, num_heads, rope_dim, generator=gen)
    return q_lat.to(dtype).to(device), q_pe.to(dtype).to(device)


def assert_close(out, ref, dtype):
    assert not out.isnan().any(), "NaN in the output: an element was not written or a masked value leaked"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_absorbed_reference_is_attention_over_the_expanded_heads():
    """Keys [W_UK c ; k_pe] and values W_UV c per head, as transformers expands them, against the reference over
    the latents with q_lat = q_nope W_UK and its output taken through W_UV: a chunk of 7 queries after 30 cached."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope_dim, v_dim, latent_dim, seq_len, q_len = 4, 16, 8, 12, 32, 37, 7
    latent_cache, rope_cache, block_tables, (c,), (k_pe,), _ = make_pool([seq_len], latent_dim, rope_dim, 4,
                                                                          torch.float32, "cpu")
    w_uk = torch.randn(heads, nope, latent_dim, generator=gen, dtype=torch.float32)
    w_uv = torch.randn(heads, v_dim, latent_dim, generator=gen, dtype=torch.float32)
    q_nope = torch.randn(q_len, heads, nope, generator=gen, dtype=torch.float32)
    q_pe = torch.randn(q_len, heads, rope_dim, generator=gen, dtype=torch.float32)
    scale = (nope + rope_dim) ** -0.5
    keys = torch.cat([torch.einsum("hdl,sl->shd", w_uk, c), k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
    values = torch.einsum("hvl,sl->shv", w_uv, c)
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = torch.einsum("qhd,shd->hqs", torch.cat([q_nope, q_pe], -1), keys) * scale
    expected = torch.einsum("hqs,shv->qhv", scores.masked_fill(~mask, float("-inf")).softmax(-1), values)
    q_lat = torch.einsum("qhd,hdl->qhl", q_nope, w_uk)
    out_lat = mla_attention_ref(q_lat, q_pe, latent_cache, rope_cache, block_tables, int32([0, q_len], "cpu"),
                                int32([seq_len], "cpu"), scale)
    torch.testing.assert_close(torch.einsum("qhl,hvl->qhv", out_lat, w_uv), expected, rtol=1e-5, atol=1e-5)


# (heads, latent_dim, rope_dim): DeepSeek's 16 heads of 512 + 64 at a small size; heads past a block of 16; a
# latent that is not a power of two and a rope part under tl.dot's 16
SHAPES = [(16, 64, 16), (20, 32, 16), (2, 48, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, latent_dim, rope_dim", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_reference(device, dtype, heads, latent_dim, rope_dim, num_splits, poisoned_allocations):
    seq_lens = [1, 17, 40, 0]  # a padding row last (seq_len 0: zeros)
    latent_cache, rope_cache, block_tables, *_ = make_pool(seq_lens, latent_dim, rope_dim, 4, dtype, device)
    q_lat, q_pe = queries(len(seq_lens), heads, latent_dim, rope_dim, dtype, device)
    args = (q_lat, q_pe, latent_cache, rope_cache, block_tables, int32(seq_lens, device), 0.3)
    out = mla_decode_triton(*args, num_splits=num_splits)
    assert_close(out, mla_attention_ref(*args[:5], None, *args[5:]), dtype)
    assert out[3].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, latent_dim, rope_dim", SHAPES[:2])
def test_decode_kernel_with_an_fp8_pool(device, dtype, heads, latent_dim, rope_dim):
    seq_lens = [23, 5]
    latent_cache, rope_cache, block_tables, _, _, scales = make_pool(seq_lens, latent_dim, rope_dim, 16, dtype, device,
                                                                     fp8=True)
    q_lat, q_pe = queries(len(seq_lens), heads, latent_dim, rope_dim, dtype, device)
    args = (q_lat, q_pe, latent_cache, rope_cache, block_tables, int32(seq_lens, device), 0.3)
    out = mla_decode_triton(*args, *scales, num_splits=2)
    assert_close(out, mla_attention_ref(*args[:5], None, *args[5:], *scales), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, latent_dim, rope_dim", SHAPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["pool", "fp8-pool"])
def test_prefill_kernel_matches_reference(device, dtype, heads, latent_dim, rope_dim, fp8, poisoned_allocations):
    """A whole prompt, a chunk over cached latents, a decode row and a chunk crossing several key tiles."""
    seq_lens, q_lens = [5, 33, 9, 40], [5, 10, 1, 21]
    latent_cache, rope_cache, block_tables, _, _, scales = make_pool(seq_lens, latent_dim, rope_dim, 4, dtype, device,
                                                                     fp8=fp8)
    q_lat, q_pe = queries(sum(q_lens), heads, latent_dim, rope_dim, dtype, device)
    starts = int32([0, *itertools.accumulate(q_lens)], device)
    args = (q_lat, q_pe, latent_cache, rope_cache, block_tables, starts, int32(seq_lens, device), 0.3)
    out = mla_prefill_triton(*args, max(q_lens), *scales)
    assert_close(out, mla_attention_ref(*args, *scales), dtype)


@pytest.mark.parametrize("fp8", [False, True], ids=["pool", "fp8-pool"])
def test_write_kernel_matches_reference(device, fp8):
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn(6, 48, generator=gen).to(device)
    k_pe = torch.randn(6, 8, generator=gen).to(device)
    slots = torch.tensor([5, 0, -1, 17, 9, 30], device=device)  # -1: a padding token
    scales = (torch.tensor([0.5], device=device), torch.tensor([2.0], device=device)) if fp8 else (None, None)
    pools = []
    for write in (write_latent_cache_triton, write_latent_cache_ref):
        latent_cache = torch.zeros(8, 4, 1, 48, device=device).to(FP8_DTYPE if fp8 else torch.float32)
        rope_cache = torch.zeros(8, 4, 1, 8, device=device).to(latent_cache.dtype)
        write(latent, k_pe, latent_cache, rope_cache, slots, *scales)
        pools.append((latent_cache, rope_cache))
    for got, expected in zip(*pools):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert pools[0][0].float().flatten(0, 1)[17, 0].abs().sum() > 0 and pools[0][0].float().flatten(0, 1)[2].eq(0).all()


def test_mla_benchmark_cases_run_under_the_interpreter(device, monkeypatch):
    """benchmarks/kernels_mla.py at toy sizes (its GPU run is the lead's): every case builds, matches the reference
    under --check and is timed (once here), decode in pool bytes and prefill in FLOPs."""
    import benchmarks.kernels as bench
    from benchmarks import kernels_mla

    monkeypatch.setattr(bench, "time_ms", lambda fn, device: (fn(), 1.0)[1])
    runner = bench.Runner(device, check=True, use_triton=True)
    kernels_mla.bench_mla(runner, {"dtype": torch.float32}, kernels_mla.SMOKE_MLA)
    assert not runner.failures, runner.failures
    rows = {(r["kernel"], r["case"], r["impl"]): r for r in runner.results}
    assert rows[("mla decode", "batch 4 ctx 256", "triton")]["bytes"] == 4 * 256 * (32 + 16) * 4
    assert ("mla decode", "batch 1 ctx 64", "triton split=1") in rows
    assert rows[("mla prefill", "64 tokens", "triton")]["flops"] == 64 * 64 * 4 * (2 * 32 + 16)
