"""Multi-head latent attention (DeepSeek-V2's MLA) over a paged latent pool, in the absorbed form.

A latent pool (workers/kv_pool.py KVLayout.latent) holds per token and layer the compressed KV c (kv_lora_rank
values, already through kv_a_layernorm) and the one rotated key k_pe (qk_rope_head_dim values) that every head
shares:

    latent_cache [num_blocks, block_size, 1, L]     rope_cache [num_blocks, block_size, 1, R]

Head h's key is [W_UK[h] c ; k_pe] and its value W_UV[h] c. Folding W_UK into the query (q_lat = q_nope W_UK[h],
[L] a head) makes every head attend over the latents themselves, as one multi-query attention with one "KV head"
of L + R dims:

    score(t, h, s) = (q_lat[t, h] . c[s] + q_pe[t, h] . k_pe[s]) * scale        out_lat[t, h] = sum_s p c[s]

and the caller takes out_lat through W_UV[h] (then o_proj). Exact reassociation of the expanded form's sums: the
same values up to float rounding. Paging, packing and causality are paged_attention's: sequence b's queries are rows
query_start_loc[b]:query_start_loc[b+1] at the last positions of its seq_lens[b] tokens, which are in the pool
already (`write_latent_cache` at slot_mapping).

A float8_e4m3fn pool stores c / latent_scale and k_pe / rope_scale (float32 [1] powers of two each,
workers/kv_scales.py); readers multiply back.
"""

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    is_interpreting,
    next_power_of_2,
    pdl_options,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.fp8 import FP8_DTYPE, dequantize, quantize_ref, to_e4m3
from kernels.paged_attention import LOG2E, MIN_SPLIT_TOKENS, decode_num_splits, find_query_block


def _check_cache(name: str, cache: torch.Tensor, dim: int, scale, dtype: torch.dtype) -> None:
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != dim:
        raise ValueError(f"{name} must be [num_blocks, block_size, 1, {dim}], got {tuple(cache.shape)}")
    if cache.dtype not in (dtype, FP8_DTYPE):
        raise ValueError(f"{name} dtype {cache.dtype} must be {dtype} or float8_e4m3fn")
    if cache.dtype == FP8_DTYPE:
        if scale is None or scale.shape != (1,) or scale.dtype != torch.float32:
            raise ValueError(f"{name}: a float8 pool takes a float32 [1] scale, got "
                             f"{None if scale is None else (scale.dtype, tuple(scale.shape))}")
    elif scale is not None:
        raise ValueError(f"{name}: a scale is for a float8_e4m3fn pool, not {cache.dtype}")


def check_latent_caches(latent_cache, rope_cache, latent_dim: int, rope_dim: int, dtype: torch.dtype,
                        latent_scale=None, rope_scale=None) -> None:
    _check_cache("latent_cache", latent_cache, latent_dim, latent_scale, dtype)
    _check_cache("rope_cache", rope_cache, rope_dim, rope_scale, dtype)
    if rope_cache.shape[:2] != latent_cache.shape[:2] or rope_cache.dtype != latent_cache.dtype:
        raise ValueError(f"rope_cache {tuple(rope_cache.shape)} {rope_cache.dtype} must have latent_cache's blocks "
                         f"and dtype ({tuple(latent_cache.shape)} {latent_cache.dtype})")


def _check_queries(q_lat, q_pe, latent_cache, rope_cache, latent_scale, rope_scale) -> None:
    if q_lat.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"q_lat [T, H, L] and q_pe [T, H, R] must share T and H, got {tuple(q_lat.shape)} and "
                         f"{tuple(q_pe.shape)}")
    check_dtype("q_lat", q_lat, FLOAT_DTYPES)
    if q_pe.dtype != q_lat.dtype:
        raise ValueError(f"q_pe dtype {q_pe.dtype} != q_lat dtype {q_lat.dtype}")
    check_latent_caches(latent_cache, rope_cache, q_lat.shape[2], q_pe.shape[2], q_lat.dtype, latent_scale,
                        rope_scale)


def _check_batch(block_tables, seq_lens, query_start_loc, num_tokens: int) -> None:
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables [num_seqs, max_blocks] and seq_lens [num_seqs] must agree, got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if query_start_loc is not None and query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t is not None:
            check_dtype(name, t, (torch.int32,))


# ---- the KV write ----------------------------------------------------------------------------------------------
def _check_write(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale, rope_scale) -> None:
    if latent.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != latent.shape[0]:
        raise ValueError(f"latent [T, L] and k_pe [T, R] must share T, got {tuple(latent.shape)}, {tuple(k_pe.shape)}")
    check_dtype("latent", latent, FLOAT_DTYPES)
    if k_pe.dtype != latent.dtype:
        raise ValueError(f"k_pe dtype {k_pe.dtype} != latent dtype {latent.dtype}")
    check_latent_caches(latent_cache, rope_cache, latent.shape[1], k_pe.shape[1], latent.dtype, latent_scale,
                        rope_scale)
    if slot_mapping.shape != (latent.shape[0],):
        raise ValueError(f"slot_mapping must be [T={latent.shape[0]}], got {tuple(slot_mapping.shape)}")
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))


def write_latent_cache_ref(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale=None,
                           rope_scale=None) -> None:
    """Torch reference of `write_latent_cache` (and its CPU implementation)."""
    _check_write(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale, rope_scale)
    block_size = latent_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    latent, k_pe = latent[keep], k_pe[keep]
    if latent_cache.dtype == FP8_DTYPE:
        latent, k_pe = quantize_ref(latent, 1.0 / latent_scale), quantize_ref(k_pe, 1.0 / rope_scale)
    latent_cache[blocks, offsets, 0] = latent
    rope_cache[blocks, offsets, 0] = k_pe


@triton.jit
def _write_row(src_ptr, dst_ptr, scale_ptr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, FP8: tl.constexpr,
               EXACT: tl.constexpr):
    dims = tl.arange(0, DIM_PAD)
    x = tl.load(src_ptr + dims, mask=dims < DIM)
    if FP8:  # x / scale (a power of two: its reciprocal is exact) rounded to e4m3
        x = to_e4m3(x.to(tl.float32) * (1.0 / tl.load(scale_ptr)), EXACT)
    tl.store(dst_ptr + dims, x, mask=dims < DIM)


@triton.jit
def _write_latent_kernel(
    latent_ptr, k_pe_ptr, latent_cache_ptr, rope_cache_ptr, slot_mapping_ptr, latent_scale_ptr, rope_scale_ptr,
    stride_lt, stride_kt, stride_lcb, stride_lcs, stride_rcb, stride_rcs,
    L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    token = tl.program_id(0).to(tl.int64)  # one program a token: its latent and its rope key
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding token
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        _write_row(latent_ptr + token * stride_lt, latent_cache_ptr + block * stride_lcb + offset * stride_lcs,
                   latent_scale_ptr, L, L_PAD, FP8, EXACT)
        _write_row(k_pe_ptr + token * stride_kt, rope_cache_ptr + block * stride_rcb + offset * stride_rcs,
                   rope_scale_ptr, R, R_PAD, FP8, EXACT)


def write_latent_cache_triton(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale=None,
                              rope_scale=None) -> None:
    """Triton launcher of `write_latent_cache` (latent and k_pe may be row-strided views)."""
    _check_write(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale, rope_scale)
    check_launchable(latent, k_pe, latent_cache, rope_cache, slot_mapping)
    for name, t in (("latent", latent), ("k_pe", k_pe), ("latent_cache", latent_cache), ("rope_cache", rope_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens, latent_dim = latent.shape
    if num_tokens == 0:
        return
    fp8 = latent_cache.dtype == FP8_DTYPE
    _write_latent_kernel[(num_tokens,)](
        latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale if fp8 else latent,
        rope_scale if fp8 else latent, latent.stride(0), k_pe.stride(0), *latent_cache.stride()[:2],
        *rope_cache.stride()[:2], L=latent_dim, R=k_pe.shape[1], L_PAD=next_power_of_2(latent_dim),
        R_PAD=next_power_of_2(k_pe.shape[1]), BLOCK_SIZE=latent_cache.shape[1], FP8=fp8, EXACT=is_interpreting(),
        **pdl_options(latent.device), num_warps=4,
    )


def write_latent_cache(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale=None,
                       rope_scale=None) -> None:
    """Writes each token's latent [T, L] and rotated key [T, R] into the pool at slot_mapping [T] (int64, slot =
    block * block_size + offset; -1: a padding token, nothing written); a float8 pool takes its scales."""
    if use_triton(latent):
        write_latent_cache_triton(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale, rope_scale)
    else:
        write_latent_cache_ref(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale, rope_scale)


# ---- attention -------------------------------------------------------------------------------------------------
def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale) -> torch.Tensor:
    """A sequence's first seq_len tokens of a latent pool tensor, float32 [seq_len, D] (dequantized)."""
    blocks = block_table[: cdiv(seq_len, cache.shape[1])].long()
    tokens = cache[blocks].flatten(0, 1)[:seq_len, 0]
    return tokens.float() if scale is None else dequantize(tokens, scale)


def _attend_latent(q_lat, q_pe, latent, rope, q_pos, scale) -> torch.Tensor:
    """q_lat [Lq, H, L], q_pe [Lq, H, R] at positions q_pos [Lq] over latent [S, L], rope [S, R] (float32),
    causal by position; float32 softmax -> [Lq, H, L] in q_lat's dtype."""
    scores = (torch.einsum("qhl,sl->hqs", q_lat.float(), latent)
              + torch.einsum("qhr,sr->hqs", q_pe.float(), rope)) * scale
    visible = torch.arange(latent.shape[0], device=q_lat.device)[None, :] <= q_pos[:, None]  # [Lq, S]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqs,sl->qhl", probs, latent).to(q_lat.dtype)


def mla_attention_ref(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, scale,
                      latent_scale=None, rope_scale=None) -> torch.Tensor:
    """Torch reference of `mla_prefill` (and of `mla_decode` with query_start_loc None: one query a sequence);
    the CPU implementation of both. A sequence with seq_len 0 (a padding row) gives zeros."""
    _check_queries(q_lat, q_pe, latent_cache, rope_cache, latent_scale, rope_scale)
    _check_batch(block_tables, seq_lens, query_start_loc, q_lat.shape[0])
    num_seqs = seq_lens.shape[0]
    starts = list(range(num_seqs + 1)) if query_start_loc is None else query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] != q_lat.shape[0]:
        raise ValueError(f"the queries must run from 0 to T={q_lat.shape[0]} over {num_seqs} sequences: {starts}")
    out = torch.zeros_like(q_lat)
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        if q_len == 0 or seq_len == 0:
            continue
        assert q_len <= seq_len, f"sequence {s}: query length {q_len} exceeds its KV length {seq_len}"
        latent = _gather(latent_cache, block_tables[s], seq_len, latent_scale)
        rope = _gather(rope_cache, block_tables[s], seq_len, rope_scale)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q_lat.device)
        rows = slice(starts[s], starts[s + 1])
        out[rows] = _attend_latent(q_lat[rows], q_pe[rows], latent, rope, q_pos, scale)
    return out


# ---- Triton ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_rows(ptr, rows, row_mask, DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """rows [N] of row offsets -> [N, DIM_PAD] (zeros past DIM and in masked rows)."""
    dims = tl.arange(0, DIM_PAD)
    return tl.load(ptr + rows[:, None] + dims[None, :], mask=row_mask[:, None] & (dims < DIM)[None, :], other=0.0)


@triton.jit
def _attend_latent_tile(
    acc, m_i, l_i, q_lat, q_pe, latent_cache_ptr, rope_cache_ptr, block_table_ptr, n0, kv_end, q_pos,
    stride_lb, stride_lt, stride_rb, stride_rt, qk_scale,
    L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N-token tile of online softmax (base 2) over the latents: each latent row is loaded once and serves
    as key (against q_lat) and value. Keys >= kv_end are masked; CAUSAL: also keys past each row's q_pos."""
    tokens = n0 + tl.arange(0, BLOCK_N)
    in_range = tokens < kv_end
    blocks = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    offsets = tokens % BLOCK_SIZE
    c = _load_rows(latent_cache_ptr, blocks * stride_lb + offsets * stride_lt, in_range, L, L_PAD).to(q_lat.dtype)
    k_pe = _load_rows(rope_cache_ptr, blocks * stride_rb + offsets * stride_rt, in_range, R, R_PAD).to(q_pe.dtype)
    qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)  # [M, BLOCK_N]
    qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision=DOT_PRECISION)
    visible = in_range[None, :]
    if CAUSAL:
        visible = visible & (tokens[None, :] <= q_pos[:, None])
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet (a padding row)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_queries(q_lat_ptr, q_pe_ptr, lat_rows, pe_rows, stride_qh, stride_ph, heads, row_mask, latent_scale_ptr,
                  rope_scale_ptr, L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                  UPCAST: tl.constexpr, KV_FP8: tl.constexpr):
    """The rows' q_lat [M, L_PAD] and q_pe [M, R_PAD] (lat_rows, pe_rows: each row's token offset). An e4m3 pool's
    scales (powers of two) multiply the queries once, so the tiles' dots read the e4m3 values as they are."""
    ldims = tl.arange(0, L_PAD)
    rdims = tl.arange(0, R_PAD)
    q_lat = tl.load(q_lat_ptr + lat_rows[:, None] + heads[:, None] * stride_qh + ldims[None, :],
                    mask=row_mask[:, None] & (ldims < L)[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + pe_rows[:, None] + heads[:, None] * stride_ph + rdims[None, :],
                   mask=row_mask[:, None] & (rdims < R)[None, :], other=0.0)
    if KV_FP8:
        q_lat = (q_lat.to(tl.float32) * tl.load(latent_scale_ptr)).to(q_lat.dtype)
        q_pe = (q_pe.to(tl.float32) * tl.load(rope_scale_ptr)).to(q_pe.dtype)
    if UPCAST:
        q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
    return q_lat, q_pe


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, latent_cache_ptr, rope_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, qk_scale, num_heads, latent_scale_ptr, rope_scale_ptr,
    stride_qs, stride_qh, stride_ps, stride_ph, stride_lb, stride_lt, stride_rb, stride_rt, stride_bts,
    stride_os, stride_oh,
    L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    # grid (sequences, head blocks, splits): BLOCK_H heads of one query share every latent tile they load
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    row_mask = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + seq)
    # this sequence's own length in BLOCK_N tiles, split as paged_attention's decode splits them; every split
    # writes its partial (an empty one: lse -inf, zeros) for the merge kernel
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    active = tl.maximum(tl.minimum(tl.cdiv(num_tiles, MIN_SPLIT_TILES), NUM_SPLITS), 1)
    start = tl.minimum(split, active) * num_tiles // active * BLOCK_N
    end = tl.minimum(tl.minimum(split + 1, active) * num_tiles // active * BLOCK_N, seq_len)
    seq_rows = tl.zeros([BLOCK_H], tl.int64) + seq
    q_lat, q_pe = _load_queries(q_lat_ptr, q_pe_ptr, seq_rows * stride_qs, seq_rows * stride_ps, stride_qh,
                                stride_ph, heads, row_mask, latent_scale_ptr, rope_scale_ptr, L, R, L_PAD, R_PAD,
                                UPCAST, KV_FP8)
    q_pos = tl.zeros([BLOCK_H], tl.int32) + (seq_len - 1)  # every row is the sequence's last token
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_latent_tile(
            acc, m_i, l_i, q_lat, q_pe, latent_cache_ptr, rope_cache_ptr, block_table_ptr, n0, end, q_pos,
            stride_lb, stride_lt, stride_rb, stride_rt, qk_scale, L, R, L_PAD, R_PAD, BLOCK_SIZE, BLOCK_N, False,
            DOT_PRECISION)
    if KV_FP8:
        acc = acc * tl.load(latent_scale_ptr)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty split or seq_len 0: zeros
    dims = tl.arange(0, L_PAD)
    mask = row_mask[:, None] & (dims < L)[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # part_out [num_seqs, num_heads, NUM_SPLITS, L_PAD] float32, part_lse [num_seqs, num_heads, NUM_SPLITS]
        part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * L_PAD + dims[None, :], out, mask=row_mask[:, None])
        lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))  # log2 domain; -inf for an empty split
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _mla_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, stride_os, stride_oh,
    L: tl.constexpr, L_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, L_PAD)
    part = (seq * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # empty splits weigh 0
    total = tl.sum(weights, 0)
    parts = tl.load(part_out_ptr + part[:, None] * L_PAD + dims[None, :], mask=(weights > 0.0)[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < L)


# num_seqs and num_q_blocks change with every step's batch: not specialized (paged_attention's prefill says why)
@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks"])
def _mla_prefill_kernel(
    q_lat_ptr, q_pe_ptr, latent_cache_ptr, rope_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, qk_scale, num_seqs, num_q_blocks, num_heads, latent_scale_ptr, rope_scale_ptr,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_lb, stride_lt, stride_rb, stride_rt, stride_bts,
    stride_ot, stride_oh,
    L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    # grid (query blocks, heaviest first; head blocks); rows = BLOCK_Q queries x BLOCK_H heads
    q_block = num_q_blocks - 1 - tl.program_id(0)
    head_block = tl.program_id(1)
    seq, q_start, q_len, q_block_local = find_query_block(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens in the pool before this chunk

    rows = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + rows // BLOCK_H
    heads = head_block * BLOCK_H + rows % BLOCK_H
    row_mask = (q_local < q_len) & (heads < num_heads)
    q_pos = context_len + q_local
    tokens = (q_start + q_local).to(tl.int64)
    q_lat, q_pe = _load_queries(q_lat_ptr, q_pe_ptr, tokens * stride_qt, tokens * stride_pt, stride_qh,
                                stride_ph, heads, row_mask, latent_scale_ptr, rope_scale_ptr, L, R, L_PAD, R_PAD,
                                UPCAST, KV_FP8)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, L_PAD], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
    first_pos = context_len + q_block_local * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # keys past the block's last query are never loaded
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles every row sees whole
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_latent_tile(
            acc, m_i, l_i, q_lat, q_pe, latent_cache_ptr, rope_cache_ptr, block_table_ptr, n0, kv_end, q_pos,
            stride_lb, stride_lt, stride_rb, stride_rt, qk_scale, L, R, L_PAD, R_PAD, BLOCK_SIZE, BLOCK_N, False,
            DOT_PRECISION)
    for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: causal mask
        acc, m_i, l_i = _attend_latent_tile(
            acc, m_i, l_i, q_lat, q_pe, latent_cache_ptr, rope_cache_ptr, block_table_ptr, n0, kv_end, q_pos,
            stride_lb, stride_lt, stride_rb, stride_rt, qk_scale, L, R, L_PAD, R_PAD, BLOCK_SIZE, BLOCK_N, True,
            DOT_PRECISION)
    if KV_FP8:
        acc = acc * tl.load(latent_scale_ptr)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    dims = tl.arange(0, L_PAD)
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (dims < L)[None, :])


def _dims(q_lat, q_pe) -> tuple[int, int, int, int]:
    """(L, R, L_PAD, R_PAD): the pads powers of two of at least 16 (tl.dot's least K)."""
    latent_dim, rope_dim = q_lat.shape[2], q_pe.shape[2]
    return latent_dim, rope_dim, max(16, next_power_of_2(latent_dim)), max(16, next_power_of_2(rope_dim))


def mla_decode_config(num_heads: int, dtype: torch.dtype, kv_fp8: bool = False) -> dict:
    """Tiles of the decode kernel: block_h heads share each latent tile (every head block reads the whole context:
    more heads a block read it fewer times, but hold [block_h, L] float32 accumulators), block_n keys a tile.
    Compiled for sm_90 without spills (tests/kernels/compile_sm90.py: 16 heads 198 registers; an e4m3 pool's
    conversions need 8 warps; 64-head blocks spill); not tuned on a GPU yet (benchmarks/kernels_mla.py)."""
    if dtype == torch.float32:
        return dict(block_h=16, block_n=16, num_warps=4, num_stages=1)
    wide = num_heads > 16
    return dict(block_h=32 if wide else 16, block_n=32, num_warps=8 if wide or kv_fp8 else 4, num_stages=2)


def mla_prefill_config(num_heads: int, dtype: torch.dtype, kv_fp8: bool = False) -> dict:
    """Tiles of the prefill kernel: block_m rows = block_q queries x block_h heads. 32 rows and 8 warps compile
    without spills for sm_90 (64 rows take wgmma tiles but spill 144+ bytes a thread; an e4m3 pool, 16-key tiles);
    not tuned on a GPU yet."""
    block_h = min(next_power_of_2(num_heads), 16)
    if dtype == torch.float32:
        return dict(block_m=max(16, block_h), block_h=block_h, block_n=16, num_warps=4, num_stages=1)
    return dict(block_m=max(32, block_h), block_h=block_h, block_n=16 if kv_fp8 else 32, num_warps=8, num_stages=2)


def _check_triton(q_lat, q_pe, latent_cache, rope_cache, block_tables) -> None:
    check_launchable(q_lat, q_pe, latent_cache, rope_cache, block_tables)
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("latent_cache", latent_cache), ("rope_cache", rope_cache),
                    ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)


def mla_decode_triton(q_lat, q_pe, latent_cache, rope_cache, block_tables, seq_lens, scale, latent_scale=None,
                      rope_scale=None, num_splits=None, config=None) -> torch.Tensor:
    """Triton launcher of `mla_decode`: num_splits None picks it as paged_attention's decode does (the head blocks
    in place of KV heads); config overrides keys of `mla_decode_config`."""
    _check_queries(q_lat, q_pe, latent_cache, rope_cache, latent_scale, rope_scale)
    _check_batch(block_tables, seq_lens, None, q_lat.shape[0])
    _check_triton(q_lat, q_pe, latent_cache, rope_cache, block_tables)
    num_seqs, num_heads, _ = q_lat.shape
    out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    if num_seqs == 0:
        return out
    fp8 = latent_cache.dtype == FP8_DTYPE
    cfg = mla_decode_config(num_heads, q_lat.dtype, fp8) | (config or {})
    latent_dim, rope_dim, latent_pad, rope_pad = _dims(q_lat, q_pe)
    block_size, head_blocks = latent_cache.shape[1], cdiv(num_heads, cfg["block_h"])
    min_split_tokens = MIN_SPLIT_TOKENS if num_splits is None else 1
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, head_blocks, block_tables.shape[1] * block_size, q_lat.device)
    part_out = part_lse = out  # placeholders, unused with one split
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, latent_pad, dtype=torch.float32, device=out.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=out.device)
    _mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        q_lat, q_pe, latent_cache, rope_cache, block_tables, seq_lens, out, part_out, part_lse, scale * LOG2E,
        num_heads, latent_scale if fp8 else q_lat, rope_scale if fp8 else q_lat,
        *q_lat.stride()[:2], *q_pe.stride()[:2], *latent_cache.stride()[:2], *rope_cache.stride()[:2],
        block_tables.stride(0), *out.stride()[:2],
        L=latent_dim, R=rope_dim, L_PAD=latent_pad, R_PAD=rope_pad, BLOCK_SIZE=block_size, BLOCK_H=cfg["block_h"],
        BLOCK_N=cfg["block_n"], NUM_SPLITS=num_splits, MIN_SPLIT_TILES=cdiv(min_split_tokens, cfg["block_n"]),
        UPCAST=upcast_dot_operands(q_lat.dtype, q_lat.device), DOT_PRECISION=dot_precision(q_lat.dtype),
        KV_FP8=fp8, **pdl_options(q_lat.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _mla_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_heads, *out.stride()[:2], L=latent_dim, L_PAD=latent_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=max(2, next_power_of_2(num_splits)), **pdl_options(q_lat.device),
            num_warps=4 if latent_pad * num_splits <= 8192 else 8,
        )
    return out


def mla_prefill_triton(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, scale,
                       max_query_len=None, latent_scale=None, rope_scale=None, config=None) -> torch.Tensor:
    """Triton launcher of `mla_prefill` (max_query_len is taken for the interface's sake: the tiles do not depend on
    it yet); config overrides keys of `mla_prefill_config`."""
    _check_queries(q_lat, q_pe, latent_cache, rope_cache, latent_scale, rope_scale)
    _check_batch(block_tables, seq_lens, query_start_loc, q_lat.shape[0])
    _check_triton(q_lat, q_pe, latent_cache, rope_cache, block_tables)
    num_tokens, num_heads, _ = q_lat.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    fp8 = latent_cache.dtype == FP8_DTYPE
    cfg = mla_prefill_config(num_heads, q_lat.dtype, fp8) | (config or {})
    block_q = cfg["block_m"] // cfg["block_h"]
    if block_q < 1:
        raise ValueError(f"block_m {cfg['block_m']} must hold block_h {cfg['block_h']} heads")
    latent_dim, rope_dim, latent_pad, rope_pad = _dims(q_lat, q_pe)
    num_q_blocks = num_tokens // block_q + num_seqs  # an upper bound; the spare programs return at once
    _mla_prefill_kernel[(num_q_blocks, cdiv(num_heads, cfg["block_h"]))](
        q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, out, scale * LOG2E,
        num_seqs, num_q_blocks, num_heads, latent_scale if fp8 else q_lat, rope_scale if fp8 else q_lat,
        *q_lat.stride()[:2], *q_pe.stride()[:2], *latent_cache.stride()[:2], *rope_cache.stride()[:2],
        block_tables.stride(0), *out.stride()[:2],
        L=latent_dim, R=rope_dim, L_PAD=latent_pad, R_PAD=rope_pad, BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_M=cfg["block_m"], BLOCK_Q=block_q, BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"],
        UPCAST=upcast_dot_operands(q_lat.dtype, q_lat.device), DOT_PRECISION=dot_precision(q_lat.dtype),
        KV_FP8=fp8, **pdl_options(q_lat.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def mla_decode(q_lat, q_pe, latent_cache, rope_cache, block_tables, seq_lens, scale, latent_scale=None,
               rope_scale=None) -> torch.Tensor:
    """One query per sequence (q_lat [B, H, L], q_pe [B, H, R]) over its paged latents; seq_lens [B] include the
    query's own token. Returns out_lat [B, H, L] in q_lat's dtype (a seq_len of 0, a padding row: zeros)."""
    if use_triton(q_lat):
        return mla_decode_triton(q_lat, q_pe, latent_cache, rope_cache, block_tables, seq_lens, scale, latent_scale,
                                 rope_scale)
    return mla_attention_ref(q_lat, q_pe, latent_cache, rope_cache, block_tables, None, seq_lens, scale,
                             latent_scale, rope_scale)


def mla_prefill(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, scale,
                max_query_len=None, latent_scale=None, rope_scale=None) -> torch.Tensor:
    """Causal attention of packed variable-length query chunks (rows query_start_loc[b]:query_start_loc[b+1] of
    q_lat [T, H, L] and q_pe [T, H, R]) over their paged latents: chunked prefill, prefix-cache hits and decode rows
    in one batch. Returns out_lat [T, H, L] in q_lat's dtype."""
    if use_triton(q_lat):
        return mla_prefill_triton(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens,
                                  scale, max_query_len, latent_scale, rope_scale)
    return mla_attention_ref(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, scale,
                             latent_scale, rope_scale)
