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

from kernels._triton import FLOAT_DTYPES, cdiv, check_dtype
from kernels.fp8 import FP8_DTYPE, dequantize, quantize_ref


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
def write_latent_cache_ref(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale=None,
                           rope_scale=None) -> None:
    """Torch reference of `write_latent_cache` (and its CPU implementation)."""
    if latent.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != latent.shape[0]:
        raise ValueError(f"latent [T, L] and k_pe [T, R] must share T, got {tuple(latent.shape)}, {tuple(k_pe.shape)}")
    check_latent_caches(latent_cache, rope_cache, latent.shape[1], k_pe.shape[1], latent.dtype, latent_scale,
                        rope_scale)
    if slot_mapping.shape != (latent.shape[0],):
        raise ValueError(f"slot_mapping must be [T={latent.shape[0]}], got {tuple(slot_mapping.shape)}")
    block_size = latent_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    latent, k_pe = latent[keep], k_pe[keep]
    if latent_cache.dtype == FP8_DTYPE:
        latent, k_pe = quantize_ref(latent, 1.0 / latent_scale), quantize_ref(k_pe, 1.0 / rope_scale)
    latent_cache[blocks, offsets, 0] = latent
    rope_cache[blocks, offsets, 0] = k_pe


def write_latent_cache(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale=None,
                       rope_scale=None) -> None:
    """Writes each token's latent [T, L] and rotated key [T, R] into the pool at slot_mapping [T] (int64, slot =
    block * block_size + offset; -1: a padding token, nothing written); a float8 pool takes its scales."""
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


def mla_decode(q_lat, q_pe, latent_cache, rope_cache, block_tables, seq_lens, scale, latent_scale=None,
               rope_scale=None) -> torch.Tensor:
    """One query per sequence (q_lat [B, H, L], q_pe [B, H, R]) over its paged latents; seq_lens [B] include the
    query's own token. Returns out_lat [B, H, L] in q_lat's dtype (a seq_len of 0, a padding row: zeros)."""
    return mla_attention_ref(q_lat, q_pe, latent_cache, rope_cache, block_tables, None, seq_lens, scale,
                             latent_scale, rope_scale)


def mla_prefill(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, scale,
                max_query_len=None, latent_scale=None, rope_scale=None) -> torch.Tensor:
    """Causal attention of packed variable-length query chunks (rows query_start_loc[b]:query_start_loc[b+1] of
    q_lat [T, H, L] and q_pe [T, H, R]) over their paged latents: chunked prefill, prefix-cache hits and decode rows
    in one batch. Returns out_lat [T, H, L] in q_lat's dtype."""
    return mla_attention_ref(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, scale,
                             latent_scale, rope_scale)
