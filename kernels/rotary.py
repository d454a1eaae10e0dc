"""Rotary position embedding (RoPE), neox style, applied in place to q and k.

The cache holds, for every position p, `[cos(p * inv_freq) | sin(p * inv_freq)]` (head_dim values: head_dim / 2
cosines, then head_dim / 2 sines). Each head is rotated half against half, as Hugging Face's `rotate_half`:

    x = [x1 | x2]   ->   [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

Numerics follow transformers exactly: inv_freq in float32, freqs = position * inv_freq in float32, cos/sin cast
to q's dtype, and `q * cos + rotate_half(q) * sin` with each product and the sum rounded to q's dtype.

`rotary_embedding_and_write_kv` also writes the rotated k and v into the paged cache, and with qk_norm RMSNorms each
head of q and k first (Qwen3's q_norm / k_norm), all in one kernel on a GPU: on an H100 that took Qwen3-8B's batch-1
decode from 6.07 to 5.98-5.99 ms/token (benchmarks/results/h100-latency-qwen3-head-norms-runs.txt).
"""

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    is_interpreting,
    next_power_of_2,
    pdl_options,
    tl,
    triton,
    use_triton,
    wait_for_prior,
)
from kernels.fp8 import FP8_DTYPE
from kernels.kv_cache import check_kv_cache_inputs, quantize_heads, write_kv_cache_ref
from kernels.rms_norm import normed_rounded, rms_norm_ref
from kernels.rope_scaling import compute_inv_freq


def compute_cos_sin_cache(head_dim, max_position, base, rope_scaling=None, dtype=torch.float32,
                          max_position_embeddings=None, max_model_len=None) -> torch.Tensor:
    """[max_position, head_dim]: cos(p * inv_freq) in the first half of each row, sin in the second half, both times
    the scaling's attention factor (`kernels.rope_scaling`; max_position_embeddings, the checkpoint's, and
    max_model_len default to max_position)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    inv_freq, attention_factor = compute_inv_freq(head_dim, base, rope_scaling, max_position_embeddings or max_position,
                                                  max_model_len or max_position)
    freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1).to(dtype)


@triton.jit
def _head_norm(a1, a2, norm_ptr, dims, dim_mask, eps, dtype, HALF: tl.constexpr):
    """RMSNorm of each head (rows of the halves a1 | a2, float32) over its 2 HALF dims, rounded as
    kernels/rms_norm.py rounds (`normed_rounded`), back in float32."""
    inv_rms = tl.rsqrt((tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(norm_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
    w2 = tl.load(norm_ptr + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    return (normed_rounded(a1, inv_rms, w1, dtype).to(tl.float32),
            normed_rounded(a2, inv_rms, w2, dtype).to(tl.float32))


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, cos, sin, cache_ptr, cache_row, stride_ch, slot, scale_ptr,
                  norm_ptr, eps, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr, WRITE_CACHE: tl.constexpr, FP8: tl.constexpr, NORM: tl.constexpr,
                  EXACT: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    ptr1 = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if NORM:  # Qwen3's q_norm / k_norm over each head, before the rotation
        a1, a2 = _head_norm(a1, a2, norm_ptr, dims, dims < HALF, eps, dtype, HALF)
    # Each product and the sum rounded to x's dtype, as torch computes q * cos + rotate_half(q) * sin.
    o1 = ((a1 * cos).to(dtype).to(tl.float32) - (a2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(ptr1, o1, mask=mask)
    tl.store(ptr1 + HALF, o2, mask=mask)
    if WRITE_CACHE:  # the rotated heads straight from registers into the paged cache
        cache = cache_ptr + cache_row + heads * stride_ch + dims
        cache_mask = mask & (tl.zeros_like(heads) + slot >= 0)  # slot -1: a padding token, nothing written
        if FP8:  # e4m3 of the rotated values (rounded to x's dtype first, as the reference quantizes them)
            o1 = quantize_heads(o1, scale_ptr, heads, NUM_HEADS, EXACT)
            o2 = quantize_heads(o2, scale_ptr, heads, NUM_HEADS, EXACT)
        tl.store(cache, o1, mask=cache_mask)
        tl.store(cache + HALF, o2, mask=cache_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, k_scale_ptr, v_scale_ptr,
    q_norm_ptr, k_norm_ptr, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, WRITE_CACHE: tl.constexpr,
    FP8: tl.constexpr, NORM: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    cs_ptr = cos_sin_ptr + pos * stride_cs + dims
    # cos/sin rounded to q's dtype first, as transformers casts them.
    cos = tl.load(cs_ptr, mask=dims < HALF, other=0.0).to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(cs_ptr + HALF, mask=dims < HALF, other=0.0).to(q_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos, sin, q_ptr, 0, 0, -1, k_scale_ptr, q_norm_ptr, eps,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD, False, False, NORM, EXACT)
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # -1: a padding token, nothing written
    else:
        slot = tl.full([], -1, tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos, sin, k_cache_ptr, block * stride_kcb + offset * stride_kcs,
                  stride_kch, slot, k_scale_ptr, k_norm_ptr, eps, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD,
                  WRITE_CACHE, FP8, NORM, EXACT)
    if WRITE_CACHE:
        heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        all_dims = tl.arange(0, 2 * HALF_PAD)[None, :]
        mask = (heads < NUM_KV_HEADS) & (all_dims < 2 * HALF) & (tl.zeros_like(heads) + slot >= 0)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + all_dims, mask=mask)
        if FP8:
            v = quantize_heads(v, v_scale_ptr, heads, NUM_KV_HEADS, EXACT)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + all_dims, v, mask=mask)


def _as_heads(name: str, x: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    """[T, H * head_dim] or [T, H, head_dim] -> a [T, H, head_dim] view of the same memory."""
    if x.dim() == 2 and x.shape[1] % head_dim == 0:
        x = x.unflatten(1, (x.shape[1] // head_dim, head_dim))
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != head_dim:
        raise ValueError(f"{name} must be [T={num_tokens}, heads * {head_dim}] or [T, heads, {head_dim}], "
                         f"got {tuple(x.shape)}")
    return x


def _check_inputs(positions, q, k, cos_sin_cache, head_dim):
    if positions.dim() != 1:
        raise ValueError(f"positions must be [T], got {tuple(positions.shape)}")
    check_dtype("positions", positions, (torch.int64, torch.int32))
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"cos_sin_cache must be [max_position, head_dim={head_dim}] (even), "
                         f"got {tuple(cos_sin_cache.shape)}")
    check_dtype("q", q, FLOAT_DTYPES)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} != q dtype {q.dtype}")
    num_tokens = positions.shape[0]
    return _as_heads("q", q, num_tokens, head_dim), _as_heads("k", k, num_tokens, head_dim)


def rotary_embedding_triton(positions, q, k, cos_sin_cache, head_dim, cache=None, qk_norm=None) -> None:
    """Triton launcher of `rotary_embedding` (one program per token, all its q and k heads); with
    cache=(v, k_cache, v_cache, slot_mapping[, k_scale, v_scale]), of `rotary_embedding_and_write_kv`; with
    qk_norm=(q_weight, k_weight, eps), each head RMSNorm-ed first."""
    q3, k3 = _check_inputs(positions, q, k, cos_sin_cache, head_dim)
    check_launchable(positions, q, k, cos_sin_cache)
    for name, t in (("q", q3), ("k", k3), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    if cache is None:
        v3 = k_cache = v_cache = slots = k3  # placeholders, unused
        block_size, k_scale, v_scale = 1, None, None
    else:
        v, k_cache, v_cache, slots, k_scale, v_scale = (*cache, None, None)[:6]
        v3 = _as_heads("v", v, num_tokens, head_dim)
        check_kv_cache_inputs(k3, v3, k_cache, v_cache, slots, k_scale, v_scale)
        check_launchable(v, k_cache, v_cache, slots)
        for name, t in (("v", v3), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_last_dim_contiguous(name, t)
        block_size = k_cache.shape[1]
    half = head_dim // 2
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos_sin_cache, cos_sin_cache, 0.0)
    if qk_norm is not None and not q_norm.shape == k_norm.shape == (head_dim,):
        raise ValueError(f"qk_norm weights must be [head_dim={head_dim}], got {tuple(q_norm.shape)} and "
                         f"{tuple(k_norm.shape)}")
    _rotary_kernel[(num_tokens,)](
        positions, q3, k3, cos_sin_cache, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
        cos_sin_cache.stride(0), v3, k_cache, v_cache, slots, v3.stride(0), v3.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        k_scale if k_scale is not None else cos_sin_cache, v_scale if v_scale is not None else cos_sin_cache,
        q_norm, k_norm, float(eps),
        NUM_Q_HEADS=q3.shape[1], NUM_KV_HEADS=k3.shape[1], Q_HEADS_PAD=next_power_of_2(q3.shape[1]),
        KV_HEADS_PAD=next_power_of_2(k3.shape[1]), HALF=half, HALF_PAD=next_power_of_2(half),
        BLOCK_SIZE=block_size, WRITE_CACHE=cache is not None, FP8=k_cache.dtype == FP8_DTYPE,
        NORM=qk_norm is not None, EXACT=is_interpreting(),
        **pdl_options(q3.device), num_warps=4 if q3.shape[1] * head_dim <= 4096 else 8,
    )


def rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim) -> None:
    """Torch reference of `rotary_embedding` (and its CPU implementation): transformers' apply_rotary_pos_emb."""
    q3, k3 = _check_inputs(positions, q, k, cos_sin_cache, head_dim)
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, head_dim / 2] each
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(q.dtype)  # [T, 1, head_dim]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(q.dtype)
    for x in (q3, k3):
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(x * cos + torch.cat((-x2, x1), dim=-1) * sin)


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim) -> None:
    """Rotate q [T, num_heads * head_dim] (or [T, num_heads, head_dim]) and k likewise, in place.

    positions int64 [T] index rows of cos_sin_cache [max_position, head_dim] (from `compute_cos_sin_cache`);
    every position must be < max_position.
    """
    if use_triton(q):
        rotary_embedding_triton(positions, q, k, cos_sin_cache, head_dim)
    else:
        rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim)


def rotary_embedding_and_write_kv(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache,
                                  slot_mapping, k_scale=None, v_scale=None, qk_norm=None) -> None:
    """`rotary_embedding` of q and k, then `write_kv_cache` of the rotated k and of v, in one kernel on a GPU.

    v: [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim]; caches, slot_mapping and the scales of a
    float8 cache as `write_kv_cache`. qk_norm=(q_weight [head_dim], k_weight [head_dim], eps): first each head of
    q and k RMSNorm-ed in place (Qwen3's q_norm / k_norm, `rms_norm` of the [T * heads, head_dim] rows), in the same
    kernel, where the layer ran two norms and two copies of the strided heads before.
    """
    if use_triton(q):
        rotary_embedding_triton(positions, q, k, cos_sin_cache, head_dim,
                                (v, k_cache, v_cache, slot_mapping, k_scale, v_scale), qk_norm)
    else:
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            for x, weight in ((q, q_weight), (k, k_weight)):
                x.copy_(rms_norm_ref(x.reshape(-1, head_dim), weight, eps).view(x.shape))
        rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim)
        num_tokens = positions.shape[0]
        write_kv_cache_ref(_as_heads("k", k, num_tokens, head_dim), _as_heads("v", v, num_tokens, head_dim),
                           k_cache, v_cache, slot_mapping, k_scale, v_scale)
