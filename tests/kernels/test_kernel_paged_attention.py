"""Paged attention: the references against dense SDPA, the Triton kernels against the references.

Every cache is built the way the engine fills it: each sequence's K/V scattered into shuffled blocks, unused
cache slots poisoned with NaN and unused block-table entries pointing at an all-NaN block, so a kernel that
reads anything it should not gives NaN.
"""

import itertools
import math

import pytest
import torch

import kernels.paged_attention as pa
from kernels.paged_attention import (
    decode_config,
    decode_num_splits,
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_prefill_triton,
)

# (num_heads, num_kv_heads): GQA ratios 1, 4 and 8.
HEADS = [(2, 2), (4, 1), (8, 1)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Dense per-sequence K/V and the same values in a shuffled paged cache.

    Returns k_cache, v_cache, block_tables (int32, one spare column), and the dense lists ks, vs
    ([seq_len, num_kv_heads, head_dim] each).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = free.pop()  # stays NaN: every unused block-table entry points at it
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq, default=0) + 1), poison_block, dtype=torch.int32)
    ks, vs = [], []
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        blocks = [free.pop() for _ in range(nb)]
        block_tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        for j in range(n):
            k_cache[blocks[j // block_size], j % block_size] = k[j]
            v_cache[blocks[j // block_size], j % block_size] = v[j]
        ks.append(k.to(device))
        vs.append(v.to(device))
    return k_cache.to(device), v_cache.to(device), block_tables.to(device), ks, vs


def make_queries(num_tokens, num_heads, head_dim, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def query_start_loc(q_lens, device):
    return int32([0, *itertools.accumulate(q_lens)], device)


def assert_close(out, ref, dtype):
    assert not out.isnan().any(), "NaN in the output: an element was not written or a masked value leaked"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def dense_attention(q, k, v, q_pos, scale):
    """SDPA over contiguous K/V: q [Lq, H, D] at positions q_pos, k/v [Lk, Hkv, D]."""
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# --- the references, trusted against dense SDPA ---------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_refs_match_dense_sdpa(num_heads, num_kv_heads, block_size):
    seq_lens, q_lens = [1, 9, 40, 77], [1, 9, 5, 30]  # from scratch, and chunks after a cached prefix
    scale = 0.125
    k_cache, v_cache, tables, ks, vs = make_paged_kv(seq_lens, num_kv_heads, 32, block_size, torch.float32, "cpu")
    q = make_queries(sum(q_lens), num_heads, 32, torch.float32, "cpu")
    out = paged_attention_prefill_ref(q, k_cache, v_cache, tables, query_start_loc(q_lens, "cpu"),
                                      int32(seq_lens, "cpu"), scale)
    starts = [0, *itertools.accumulate(q_lens)]
    for s, (n, m) in enumerate(zip(seq_lens, q_lens)):
        expected = dense_attention(q[starts[s] : starts[s + 1]], ks[s], vs[s], torch.arange(n - m, n), scale)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], expected, atol=1e-5, rtol=1e-5)

    q1 = make_queries(len(seq_lens), num_heads, 32, torch.float32, "cpu")
    out1 = paged_attention_decode_ref(q1, k_cache, v_cache, tables, int32(seq_lens, "cpu"), scale)
    for s, n in enumerate(seq_lens):
        expected = dense_attention(q1[s : s + 1], ks[s], vs[s], torch.tensor([n - 1]), scale)
        torch.testing.assert_close(out1[s : s + 1], expected, atol=1e-5, rtol=1e-5)


def test_decode_ref_equals_prefill_ref_with_one_query_each():
    seq_lens = [3, 17, 64]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 2, 16, 4, torch.float32, "cpu")
    q = make_queries(3, 4, 16, torch.float32, "cpu")
    decode = paged_attention_decode_ref(q, k_cache, v_cache, tables, int32(seq_lens, "cpu"), 0.25)
    prefill = paged_attention_prefill_ref(q, k_cache, v_cache, tables, query_start_loc([1, 1, 1], "cpu"),
                                          int32(seq_lens, "cpu"), 0.25)
    torch.testing.assert_close(decode, prefill, atol=0, rtol=0)


# --- decode -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])  # 3: the merge pads splits to a power of two
def test_decode_matches_ref(dtype, num_heads, num_kv_heads, block_size, num_splits, device, poisoned_allocations):
    seq_lens = [1, 16, 17, 63, 130, 300]  # block and 64-token tile boundaries, splits with empty partitions
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, num_kv_heads, 32, block_size, dtype, device)
    q = make_queries(len(seq_lens), num_heads, 32, dtype, device)
    lens = int32(seq_lens, device)
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.17, num_splits=num_splits)
    assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.17), dtype)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("fused_merge", [None, False])
def test_decode_head_dims_and_default_splits(head_dim, fused_merge, device, poisoned_allocations):
    seq_lens = [5, 1100]  # long enough for the heuristic to split (a 2-sequence batch)
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 1, head_dim, 16, torch.float16, device)
    q = make_queries(2, 4, head_dim, torch.float16, device)
    lens = int32(seq_lens, device)
    scale = head_dim**-0.5
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, scale, fused_merge=fused_merge)
    assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale), torch.float16)


@pytest.mark.parametrize("num_splits,fused_merge", [(1, False), (2, False), (2, True)])
def test_decode_padding_rows_give_zeros(num_splits, fused_merge, device, poisoned_allocations):
    k_cache, v_cache, tables, _, _ = make_paged_kv([20, 1], 1, 16, 16, torch.float32, device)
    q = make_queries(2, 2, 16, torch.float32, device)
    lens = int32([20, 0], device)  # a CUDA-graph padding row has seq_len 0
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.25, num_splits=num_splits,
                                        fused_merge=fused_merge)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.25), torch.float32)


def assert_merge_counters_zeroed():
    for counters in pa._MERGE_COUNTERS.values():
        assert not counters.any(), "the fused merge left an arrival counter set"


@pytest.mark.parametrize("fused_merge", [True, False])
def test_decode_short_sequences_in_a_wide_table_use_fewer_splits(fused_merge, device, poisoned_allocations):
    """A CUDA graph's block table is as wide as the longest context: the split count follows its width, and a
    short sequence spreads over fewer of them (MIN_SPLIT_TOKENS each; with the fused merge, one active split writes
    the output itself and the others return); the table's spare columns point at a NaN block, so a split reading
    past a sequence's end would show."""
    seq_lens = [1, 17, 300, 0]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 2, 32, 16, torch.float32, device)
    tables = torch.cat([tables, tables[:, -1:].expand(-1, 200)], 1).contiguous()  # 3520 tokens wide
    assert decode_num_splits(len(seq_lens), 2, tables.shape[1] * 16, device) > 1
    q = make_queries(len(seq_lens), 4, 32, torch.float32, device)
    lens = int32(seq_lens, device)
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.2, fused_merge=fused_merge)
    assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.2), torch.float32)
    if fused_merge:
        assert_merge_counters_zeroed()


# Each head layout, block size and split count with each merge, in 6 cases rather than all 36 (each one is seconds
# under the interpreter): the split counts are not powers of two, which the merge kernel pads.
SPLIT_CASES = [((2, 2), 16, 3, False), pytest.param((2, 2), 32, 33, True, marks=pytest.mark.slow),
               ((4, 1), 32, 5, False), ((4, 1), 16, 3, True),
               pytest.param((8, 1), 16, 33, False, marks=pytest.mark.slow), ((8, 1), 32, 5, True)]  # 33: 8 s each


@pytest.mark.parametrize("heads,block_size,num_splits,fused_merge", SPLIT_CASES)
def test_decode_split_counts_and_merges(heads, block_size, num_splits, fused_merge, device, poisoned_allocations):
    num_heads, num_kv_heads = heads
    # A padding row, one token, lengths under num_splits x 32-token tiles (empty splits), and 1100 tokens: every
    # one of 33 splits has work.
    seq_lens = [0, 1, 17, 130, 1100]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, num_kv_heads, 32, block_size, torch.float32, device)
    lens = int32(seq_lens, device)
    for seed in (1, 2):  # the second call reuses the counters the first left zeroed
        q = make_queries(len(seq_lens), num_heads, 32, torch.float32, device, seed=seed)
        out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.17, num_splits=num_splits,
                                            fused_merge=fused_merge)
        assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.17), torch.float32)
        assert_merge_counters_zeroed()


def test_decode_fused_merge_counters_grow_and_old_ones_are_kept(device, monkeypatch, poisoned_allocations):
    monkeypatch.setattr(pa, "_MERGE_COUNTERS", {})
    monkeypatch.setattr(pa, "_RETIRED_MERGE_COUNTERS", [])
    monkeypatch.setattr(pa, "MIN_MERGE_COUNTERS", 1)
    for seq_lens in ([40, 3], [40, 3, 0, 77, 1]):  # 2, then 5 (sequence, KV head) slots
        k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 1, 16, 16, torch.float32, device)
        q = make_queries(len(seq_lens), 2, 16, torch.float32, device)
        lens = int32(seq_lens, device)
        out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.25, num_splits=3, fused_merge=True)
        assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.25), torch.float32)
        assert_merge_counters_zeroed()
    assert [c.numel() for c in pa._MERGE_COUNTERS.values()] == [8]  # grown to a power of two
    assert [c.numel() for c in pa._RETIRED_MERGE_COUNTERS] == [2]  # CUDA graphs may still point at it


def test_decode_num_splits_heuristic():
    cpu = torch.device("cpu")  # counted as 132 SMs
    assert decode_num_splits(256, 8, 32768, cpu) == 1  # plenty of programs already
    assert decode_num_splits(1, 8, 256, cpu) == 1  # too short to split
    assert decode_num_splits(1, 8, 32768, cpu) == 32  # one long sequence: two programs per SM (33 wanted)
    assert decode_num_splits(1, 8, 2048, cpu) == 8  # no split under 256 tokens
    assert decode_num_splits(8, 8, 8192, cpu) == 4  # 5 wanted, rounded down to a power of two
    assert decode_num_splits(64, 8, 8192, cpu) == 1
    assert decode_num_splits(1, 1, 10**6, cpu) == 64  # capped


def test_decode_config_pipelines_deeper_when_programs_are_few():
    cpu = torch.device("cpu")  # counted as 132 SMs with 228 KiB of shared memory each
    few, many = 1 * 8 * 32, 256 * 8
    assert decode_config(128, torch.bfloat16, few, cpu)["num_stages"] == 5  # K/V tiles double-buffered
    assert decode_config(128, torch.bfloat16, many, cpu)["num_stages"] == 3
    assert decode_config(128, torch.float32, few, cpu)["block_n"] == 32  # IEEE dots: small tiles
    assert decode_config(128, torch.bfloat16, few, cpu)["fused_merge"]  # one kernel: the last split merges


# --- prefill ------------------------------------------------------------------------------------------------

PREFILL_BATCHES = {
    # name: (seq_lens, q_lens)
    "from_scratch": ([1, 17, 64, 150], [1, 17, 64, 150]),
    "prefix_then_chunk": ([100, 300, 41], [20, 77, 41]),
    "mixed_decode_and_prefill": ([1, 50, 200, 33, 129], [1, 1, 150, 1, 129]),
}


# Each batch with each head layout, the block size turning with both (a Latin square: each block size meets each
# batch and each layout once), 9 cases rather than all 27 (each is seconds under the interpreter).
PREFILL_CASES = [(batch, heads, (4, 16, 32)[(i + j) % 3])
                 for i, batch in enumerate(PREFILL_BATCHES) for j, heads in enumerate(HEADS)]


@pytest.mark.parametrize("batch,heads,block_size", PREFILL_CASES, ids=str)
def test_prefill_matches_ref(batch, heads, block_size, device, poisoned_allocations):
    num_heads, num_kv_heads = heads
    seq_lens, q_lens = PREFILL_BATCHES[batch]
    dtype = torch.float32
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, num_kv_heads, 32, block_size, dtype, device)
    q = make_queries(sum(q_lens), num_heads, 32, dtype, device)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, device), int32(seq_lens, device), 0.2)
    out = paged_attention_prefill_triton(*args, max_query_len=max(q_lens))
    assert_close(out, paged_attention_prefill_ref(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_half_precision(dtype, block_size, device, poisoned_allocations):
    seq_lens, q_lens = [90, 1, 130, 7], [40, 1, 130, 3]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 2, 64, block_size, dtype, device)
    q = make_queries(sum(q_lens), 8, 64, dtype, device)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, device), int32(seq_lens, device), 0.125)
    assert_close(paged_attention_prefill_triton(*args), paged_attention_prefill_ref(*args), dtype)


@pytest.mark.parametrize("max_query_len", [None, 1, 8])
def test_prefill_tile_hint_never_changes_results(max_query_len, device, poisoned_allocations):
    """max_query_len only sizes the query tiles; too small or absent is slower, never wrong."""
    seq_lens, q_lens = [30, 70, 5], [30, 20, 0]  # a sequence with no queries this step, too
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 1, 32, 16, torch.float32, device)
    q = make_queries(sum(q_lens), 4, 32, torch.float32, device)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, device), int32(seq_lens, device), 0.2)
    out = paged_attention_prefill_triton(*args, max_query_len=max_query_len)
    assert_close(out, paged_attention_prefill_ref(*args), torch.float32)


def test_prefill_verify_graph_layout(device, poisoned_allocations):
    """A verify CUDA graph's step (workers/inputs.py pad_verify): decodes of 1 + 0..4 tokens, padding rows without
    queries between them and the last row, which holds the leftover slots (more than the tile hint of k + 1)."""
    seq_lens, q_lens = [40, 9, 23, 1, 1, 11], [1, 3, 5, 0, 0, 11]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 2, 32, 4, torch.float32, device)
    q = make_queries(sum(q_lens), 8, 32, torch.float32, device)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, device), int32(seq_lens, device), 0.2)
    out = paged_attention_prefill_triton(*args, max_query_len=5)
    assert_close(out, paged_attention_prefill_ref(*args), torch.float32)


def test_prefill_strided_q_view(device, poisoned_allocations):
    """q as the model makes it: a [T, H, D] view into a fused qkv projection output."""
    seq_lens, q_lens = [40, 9], [40, 4]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 1, 32, 16, torch.float32, device)
    qkv = make_queries(sum(q_lens), 6, 32, torch.float32, device).flatten(1)
    q = qkv[:, : 4 * 32].unflatten(1, (4, 32))
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, device), int32(seq_lens, device), 0.2)
    assert_close(paged_attention_prefill_triton(*args), paged_attention_prefill_ref(*args), torch.float32)


# --- dispatch and input checks ------------------------------------------------------------------------------


def test_public_functions_use_the_reference_on_cpu(monkeypatch):
    import kernels.paged_attention as pa

    def fail(*args, **kwargs):
        raise AssertionError("the Triton launcher must not run for CPU tensors")

    monkeypatch.setattr(pa, "paged_attention_decode_triton", fail)
    monkeypatch.setattr(pa, "paged_attention_prefill_triton", fail)
    seq_lens = [5, 9]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 1, 16, 4, torch.float32, "cpu")
    q = make_queries(2, 2, 16, torch.float32, "cpu")
    lens = int32(seq_lens, "cpu")
    torch.testing.assert_close(paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3),
                               paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.3))
    out = paged_attention_prefill(q, k_cache, v_cache, tables, query_start_loc([1, 1], "cpu"), lens, 0.3)
    torch.testing.assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.3))


def test_launchers_reject_bad_inputs(device):
    k_cache, v_cache, tables, _, _ = make_paged_kv([5], 2, 16, 4, torch.float32, device)
    q = make_queries(1, 4, 16, torch.float32, device)
    lens = int32([5], device)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_decode_triton(q[:, :3], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        paged_attention_decode_triton(q, k_cache, v_cache, tables, lens.long(), 1.0)
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_attention_decode_triton(q, k_cache, v_cache, tables[0], lens, 1.0)
    with pytest.raises(ValueError, match="must equal q dtype"):
        paged_attention_decode_triton(q.half(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        paged_attention_decode_triton(q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache, tables,
                                      lens, 1.0)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        paged_attention_prefill_triton(q, k_cache, v_cache, tables, int32([0], device), lens, 1.0)


# --- real sizes on a GPU ------------------------------------------------------------------------------------

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8, 33])
@pytest.mark.parametrize("fused_merge", [None, False])
def test_gpu_decode_llama3_8b(num_splits, fused_merge, cuda):
    c = LLAMA3_8B
    seq_lens = [1, 15, 16, 17, 1000, 2049, 4096, 8192]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, c["num_kv_heads"], c["head_dim"], c["block_size"],
                                                   c["dtype"], cuda)
    lens = int32(seq_lens, cuda)
    scale = 1 / math.sqrt(c["head_dim"])
    for seed in (1, 2, 3):  # later calls reuse the fused merge's counters
        q = make_queries(len(seq_lens), c["num_heads"], c["head_dim"], c["dtype"], cuda, seed=seed)
        out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits,
                                            fused_merge=fused_merge)
        assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale), c["dtype"])
        assert_merge_counters_zeroed()
    if num_splits is None and fused_merge is None:  # the public function takes the same launcher on CUDA
        assert torch.equal(paged_attention_decode(q, k_cache, v_cache, tables, lens, scale), out)


@pytest.mark.gpu
def test_gpu_decode_fused_merge_in_a_cuda_graph(cuda):
    """Replays of one captured launch, with new queries and lengths each time: the counters the graph captured are
    left zeroed by every replay, and the fused and two-kernel merges agree on every one."""
    c = LLAMA3_8B
    max_seq_lens = [8192, 4096, 300, 1]
    k_cache, v_cache, tables, _, _ = make_paged_kv(max_seq_lens, c["num_kv_heads"], c["head_dim"], c["block_size"],
                                                   c["dtype"], cuda)
    q = make_queries(len(max_seq_lens), c["num_heads"], c["head_dim"], c["dtype"], cuda)
    lens = int32(max_seq_lens, cuda)
    args = (q, k_cache, v_cache, tables, lens, 1 / math.sqrt(c["head_dim"]))
    paged_attention_decode_triton(*args, num_splits=33, fused_merge=True)  # warm-up: compiles, sizes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_decode_triton(*args, num_splits=33, fused_merge=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        lens.copy_(torch.tensor([torch.randint(0, n + 1, (), generator=gen) for n in max_seq_lens]))
        graph.replay()
        expected = paged_attention_decode_triton(*args, num_splits=33, fused_merge=False)
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
        assert_merge_counters_zeroed()
    assert_close(out, paged_attention_decode_ref(*args), c["dtype"])


@pytest.mark.gpu
def test_gpu_fused_merge_never_allocates_counters_while_capturing(cuda, monkeypatch):
    monkeypatch.setattr(pa, "_MERGE_COUNTERS", {})
    k_cache, v_cache, tables, _, _ = make_paged_kv([600], 1, 64, 16, torch.bfloat16, cuda)
    q = make_queries(1, 4, 64, torch.bfloat16, cuda)
    args = (q, k_cache, v_cache, tables, int32([600], cuda), 0.125)
    with pytest.raises(RuntimeError, match="during CUDA graph capture"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        paged_attention_decode_triton(*args, num_splits=2, fused_merge=True)


@pytest.mark.gpu
def test_gpu_prefill_llama3_8b(cuda):
    c = LLAMA3_8B
    seq_lens, q_lens = [8192, 3000, 1, 700, 4100], [512, 1000, 1, 700, 1]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, c["num_kv_heads"], c["head_dim"], c["block_size"],
                                                   c["dtype"], cuda)
    q = make_queries(sum(q_lens), c["num_heads"], c["head_dim"], c["dtype"], cuda)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, cuda), int32(seq_lens, cuda),
            1 / math.sqrt(c["head_dim"]))
    for max_query_len in (None, max(q_lens)):
        out = paged_attention_prefill_triton(*args, max_query_len=max_query_len)
        assert_close(out, paged_attention_prefill_ref(*args), c["dtype"])
    assert_close(paged_attention_prefill(*args), paged_attention_prefill_ref(*args), c["dtype"])
