"""Write the new tokens' keys and values into the paged KV cache.

The cache of one layer is two tensors, one for K and one for V, each `[num_blocks, block_size, num_kv_heads,
head_dim]`. A token's slot is `block_id * block_size + offset`; the block manager hands out the block ids:

    slot_mapping  = [ 37, 38, -1, 160 ]                 block_size = 16
                      │    │    │   └─ block 10, offset 0
                      │    └────┼───── block 2, offsets 5, 6
                      └─────────┘     (-1: a padding token; nothing is written)

    k_cache[2, 5] ← k[0]    k_cache[2, 6] ← k[1]    k_cache[10, 0] ← k[3]
"""

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
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
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims, v, mask=mask)


def check_kv_cache_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
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
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != k.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != k dtype {k.dtype} (no quantized cache yet)")


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Triton launcher of `write_kv_cache`: k, v may be strided views (e.g. slices of a fused qkv output)."""
    check_kv_cache_inputs(k, v, k_cache, v_cache, slot_mapping)
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
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=next_power_of_2(num_heads), DIM_PAD=next_power_of_2(head_dim),
        num_warps=4 if pad <= 2048 else 8,
    )


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Torch reference of `write_kv_cache` (and its CPU implementation)."""
    check_kv_cache_inputs(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter k, v [T, num_kv_heads, head_dim] into k_cache, v_cache at slot_mapping [T] (int64; -1 = skip).

    Writes in place into the caches; k and v are not modified. Slots must lie in [0, num_blocks * block_size)
    or be -1; two tokens never share a slot.
    """
    if use_triton(k):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
