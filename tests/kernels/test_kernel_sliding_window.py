"""Sliding-window paged attention (Mistral v0.1, Qwen2 `use_sliding_window`, Phi-3): a query at position p sees
keys p - W + 1 .. p. The references against dense SDPA with transformers' window mask; the Triton kernels against
the references, with every key tile wholly before a window poisoned with NaN, so a kernel that reads one fails."""

import itertools
import math

import pytest
import torch

from kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
    paged_attention_prefill_ref,
    paged_attention_prefill_triton,
)
from tests.kernels.test_kernel_paged_attention import (
    PREFILL_BATCHES,
    assert_close,
    int32,
    make_paged_kv,
    make_queries,
    query_start_loc,
)

POISON_TILE = 64  # a multiple of every BLOCK_N the kernels use: whole tiles before a window are poisoned


def poison_before(cache, table, first_visible: int) -> None:
    """NaN into one sequence's tokens 0 .. first_visible rounded down to POISON_TILE (tiles no query may read)."""
    block_size = cache.shape[1]
    for token in range(first_visible // POISON_TILE * POISON_TILE):
        cache[table[token // block_size].long(), token % block_size] = float("nan")


def windowed_sdpa(q, k, v, q_pos, scale, window):
    key_pos = torch.arange(k.shape[0])[None, :]
    mask = (key_pos <= q_pos[:, None]) & (key_pos > q_pos[:, None] - window)  # transformers' sliding_window_overlay
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
        enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("window", [1, 6, 33])
def test_refs_match_windowed_sdpa(window):
    seq_lens, q_lens = [1, 9, 40, 77], [1, 9, 5, 30]
    k_cache, v_cache, tables, ks, vs = make_paged_kv(seq_lens, 2, 32, 4, torch.float32, "cpu")
    q = make_queries(sum(q_lens), 4, 32, torch.float32, "cpu")
    out = paged_attention_prefill_ref(q, k_cache, v_cache, tables, query_start_loc(q_lens, "cpu"),
                                      int32(seq_lens, "cpu"), 0.2, sliding_window=window)
    q1 = make_queries(len(seq_lens), 4, 32, torch.float32, "cpu", seed=3)
    out1 = paged_attention_decode_ref(q1, k_cache, v_cache, tables, int32(seq_lens, "cpu"), 0.2, window)
    starts = [0, *itertools.accumulate(q_lens)]
    for s, (n, m) in enumerate(zip(seq_lens, q_lens)):
        expected = windowed_sdpa(q[starts[s]:starts[s + 1]], ks[s], vs[s], torch.arange(n - m, n), 0.2, window)
        torch.testing.assert_close(out[starts[s]:starts[s + 1]], expected, atol=1e-5, rtol=1e-5)
        expected = windowed_sdpa(q1[s:s + 1], ks[s], vs[s], torch.tensor([n - 1]), 0.2, window)
        torch.testing.assert_close(out1[s:s + 1], expected, atol=1e-5, rtol=1e-5)
    unwindowed = paged_attention_decode_ref(q1, k_cache, v_cache, tables, int32(seq_lens, "cpu"), 0.2)
    assert not torch.allclose(out1[2:], unwindowed[2:])  # sequences longer than the window: the window matters


@pytest.mark.parametrize("window,num_heads,num_kv_heads", [(1, 2, 2), (5, 4, 1), (40, 2, 2), (100, 4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_splits,fused_merge", [(1, False), (3, False), (3, True), (None, None)])
def test_decode_window_matches_ref(window, num_heads, num_kv_heads, block_size, num_splits, fused_merge, device,
                                   poisoned_allocations):
    seq_lens = [0, 1, 17, 63, 130, 300]  # a padding row, and windows starting mid-tile, on a tile, at 0
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, num_kv_heads, 32, block_size, torch.float32, device)
    q = make_queries(len(seq_lens), num_heads, 32, torch.float32, device)
    lens = int32(seq_lens, device)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.17, window)
    for s, n in enumerate(seq_lens):
        poison_before(k_cache, tables[s], n - window)
        poison_before(v_cache, tables[s], n - window)
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.17, num_splits=num_splits,
                                        fused_merge=fused_merge, sliding_window=window)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("batch,window,num_heads,num_kv_heads", [
    ("from_scratch", 1, 2, 2), ("mixed_decode_and_prefill", 1, 2, 2), ("from_scratch", 7, 8, 1),
    ("prefix_then_chunk", 7, 8, 1), ("prefix_then_chunk", 90, 2, 2), ("mixed_decode_and_prefill", 90, 2, 2),
    ("from_scratch", 1000, 2, 2)])  # 1000: wider than every sequence
def test_prefill_window_matches_ref(batch, window, num_heads, num_kv_heads, device, poisoned_allocations):
    seq_lens, q_lens = PREFILL_BATCHES[batch]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, num_kv_heads, 32, 16, torch.float32, device)
    q = make_queries(sum(q_lens), num_heads, 32, torch.float32, device)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, device), int32(seq_lens, device), 0.2)
    ref = paged_attention_prefill_ref(*args, sliding_window=window)
    for s, (n, m) in enumerate(zip(seq_lens, q_lens)):
        poison_before(k_cache, tables[s], n - m - window + 1)  # before the first query's window
        poison_before(v_cache, tables[s], n - m - window + 1)
    out = paged_attention_prefill_triton(*args, max_query_len=max(q_lens), sliding_window=window)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_half_precision(dtype, device, poisoned_allocations):
    seq_lens, q_lens = [90, 1, 130, 7], [40, 1, 130, 3]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 2, 64, 16, dtype, device)
    q = make_queries(sum(q_lens), 8, 64, dtype, device)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, device), int32(seq_lens, device), 0.125)
    assert_close(paged_attention_prefill_triton(*args, sliding_window=24),
                 paged_attention_prefill_ref(*args, sliding_window=24), dtype)
    q1, lens = q[:4], int32(seq_lens, device)
    assert_close(paged_attention_decode_triton(q1, k_cache, v_cache, tables, lens, 0.125, sliding_window=24),
                 paged_attention_decode_ref(q1, k_cache, v_cache, tables, lens, 0.125, 24), dtype)


def test_bad_window_is_refused(device):
    k_cache, v_cache, tables, _, _ = make_paged_kv([5], 1, 16, 4, torch.float32, device)
    q = make_queries(1, 2, 16, torch.float32, device)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            paged_attention_decode(q, k_cache, v_cache, tables, int32([5], device), 1.0, sliding_window=bad)


@pytest.mark.gpu
def test_gpu_window_mistral_sizes(cuda):
    """Mistral-7B v0.1's heads and 4096-token window at contexts past it, both kernels, bf16."""
    window, seq_lens, q_lens = 4096, [8192, 5000, 1, 4100, 300], [512, 1000, 1, 1, 300]
    k_cache, v_cache, tables, _, _ = make_paged_kv(seq_lens, 8, 128, 16, torch.bfloat16, cuda)
    q = make_queries(sum(q_lens), 32, 128, torch.bfloat16, cuda)
    scale = 1 / math.sqrt(128)
    args = (q, k_cache, v_cache, tables, query_start_loc(q_lens, cuda), int32(seq_lens, cuda), scale)
    assert_close(paged_attention_prefill_triton(*args, sliding_window=window),
                 paged_attention_prefill_ref(*args, sliding_window=window), torch.bfloat16)
    q1, lens = make_queries(len(seq_lens), 32, 128, torch.bfloat16, cuda, seed=5), int32(seq_lens, cuda)
    ref = paged_attention_decode_ref(q1, k_cache, v_cache, tables, lens, scale, window)
    for s, n in enumerate(seq_lens):
        poison_before(k_cache, tables[s], n - window)
        poison_before(v_cache, tables[s], n - window)
    for num_splits in (None, 1, 8):
        out = paged_attention_decode_triton(q1, k_cache, v_cache, tables, lens, scale, num_splits=num_splits,
                                            sliding_window=window)
        assert_close(out, ref, torch.bfloat16)
