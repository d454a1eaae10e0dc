"""Write the new tokens' keys and values into the paged KV cache.

The cache of one layer is two tensors, one for K and one for V, each `[num_blocks, block_size, num_kv_heads,
head_dim]`. A token's slot is `block_id * block_size + offset`; the block manager hands out the block ids:

    slot_mapping  = [ 37, 38, -1, 160 ]                 block_size = 16
                      │    │    │   └─ block 10, offset 0
                      │    └────┼───── block 2, offsets 5, 6
                      └─────────┘     (-1: a padding token; nothing is written)

    k_cache[2, 5] ← k[0]    k_cache[2, 6] ← k[1]    k_cache[10, 0] ← k[3]

A float8_e4m3fn cache (kv_cache_dtype="fp8") stores k / k_scale[head] rounded to e4m3, with k_scale and v_scale
float32 [num_kv_heads] powers of two (kernels/fp8.py): readers multiply back.
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
from kernels.fp8 import FP8_DTYPE, quantize_ref, to_e4m3


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    k_scale_ptr, v_scale_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    # One program per token: all of its heads, K and V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8:
        k = quantize_heads(k, k_scale_ptr, heads, NUM_HEADS, EXACT)
        v = quantize_heads(v, v_scale_ptr, heads, NUM_HEADS, EXACT)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims, v, mask=mask)


@triton.jit
def quantize_heads(x, scale_ptr, heads, NUM_HEADS: tl.constexpr, EXACT: tl.constexpr):
    """x [heads, dims] -> e4m3 x / scale[head] (a power of two: the reciprocal from its exponent bits)."""
    scale = tl.load(scale_ptr + heads, mask=heads < NUM_HEADS, other=1.0)
    inv = ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    return to_e4m3(x.to(tl.float32) * inv, EXACT)


def check_kv_scales(k_cache, k_scale, v_scale) -> None:
    """A float8 cache needs float32 [num_kv_heads] scales; another cache takes none."""
    if k_cache.dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for a float8_e4m3fn cache, not {k_cache.dtype}")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.shape != (k_cache.shape[2],) or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [num_kv_heads={k_cache.shape[2]}] for a float8 cache, got "
                             f"{None if scale is None else (scale.dtype, tuple(scale.shape))}")


def check_kv_cache_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [T, num_kv_heads, head_dim] of one shape, got {k.shape} and {v.shape}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] of one shape, "
            f"got {k_cache.shape} and {v_cache.shape}"
        )
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {tuple(k.shape[1:])}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_dtype("k", k, FLOAT_DTYPES)
    if v.dtype != k.dtype:
        raise ValueError(f"v dtype {v.dtype} != k dtype {k.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (k.dtype, FP8_DTYPE):
            raise ValueError(f"{name} dtype {t.dtype} must be k's ({k.dtype}) or float8_e4m3fn")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check_kv_scales(k_cache, k_scale, v_scale)


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Triton launcher of `write_kv_cache`: k, v may be strided views (e.g. slices of a fused qkv output)."""
    check_kv_cache_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_launchable(k, v, k_cache, v_cache, slot_mapping)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    pad = next_power_of_2(num_heads) * next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale if k_scale is not None else k, v_scale if v_scale is not None else v,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=next_power_of_2(num_heads), DIM_PAD=next_power_of_2(head_dim),
        FP8=k_cache.dtype == FP8_DTYPE, EXACT=is_interpreting(),
        **pdl_options(k.device), num_warps=4 if pad <= 2048 else 8,
    )


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Torch reference of `write_kv_cache` (and its CPU implementation)."""
    check_kv_cache_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k, v = k[keep], v[keep]
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantize_ref(k, (1.0 / k_scale)[:, None]), quantize_ref(v, (1.0 / v_scale)[:, None])
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter k, v [T, num_kv_heads, head_dim] into k_cache, v_cache at slot_mapping [T] (int64; -1 = skip).

    Writes in place into the caches; k and v are not modified. Slots must lie in [0, num_blocks * block_size)
    or be -1; two tokens never share a slot. A float8 cache takes k_scale, v_scale [num_kv_heads].
    """
    if use_triton(k):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
