"""Int experts at decode sizes: the fused MoE's grouped GEMM over packed integers, streamed as kernels/int_decode.py
streams a dense int layer.

kernels/moe_quant.py's int GEMM dequantizes a [BLOCK_K, BLOCK_N] tile element by element (each packed word loaded
once per value it holds at 16-row tiles), the first int linear's design, which ran at 0.4-3% of copy bandwidth;
on an H100 (2026-12-06, `pagoda bench latency --preset deepseek-v2-lite --quantization awq`) DeepSeek-V2-Lite's
AWQ experts made its batch-1 decode 26.2 ms/token against 4.3 in bf16. Here a 16-row tile of one expert's (token,
slot) pairs (kernels/moe.py's expert alignment) is kernels/int_decode.py's tile: `_n_packed_tile` (AWQ, packed
along N) or `_k_packed_tile` (GPTQ / pack-quantized, along K) over that expert's packed words, each loaded once by
cp.async and unpacked in the tensor-core operand layout, the rows of x gathered by pair. When the chosen experts'
column tiles are too few to fill the GPU (a batch-1 step: K experts times N / BLOCK_N), K is split and the tile's
last program adds the slices (in slice order: the sums do not depend on which program is last), as the dense
kernel does. The epilogue is the grouped GEMM's (`store_pair_rows`: SiLU-and-mul, routing weights).

`takes` says which layers it takes: the layouts the dense stream kernel takes (no act-order; K tiles inside one
group, or along K whole groups a tile: GGUF's experts, their mins too), at the 16-row tiles of kernels/moe.py's
`moe_config`; the others keep kernels/moe_quant.py's GEMM.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, is_interpreting, pdl_options, split_counts, tl, triton, wait_for_prior
from kernels.int_decode import (
    PAIR_UNPACK,
    _k_packed_tile,
    _n_packed_tile,
    can_pair_unpack,
    can_stream,
    row_of_slices,
    split_k,
    stream_config,
)
from kernels.linear import store_split_k_slice
from kernels.moe import store_pair_rows

STREAM = True  # the int experts' decode-sized GEMMs here (False: kernels/moe_quant.py's GEMM, for A/B timings)


def takes(experts, block_m: int, gated: bool) -> bool:
    """Whether `moe_int_stream` takes this projection's experts (IntExperts) at tiles of block_m rows."""
    n, k = experts.shape
    out_features = n // 2 if gated else n
    packing = experts.packing
    if not STREAM or block_m != 16 or (gated and out_features % packing.pack_factor):
        return False
    return can_stream(packing, experts.g_idx, experts.group_size or k, k, out_features, 1, 16)


@triton.jit
def _pair_tile(a_ptr, qw_e, qz_e, s_e, a_rows, row_mask, stride_a, stride_w, stride_z, stride_s, n0, c0, N,
               col_begin, word_begin, k_begin, k_end, group_size, BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr,
               AWQ_ORDER: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_MINS: tl.constexpr, ROW_SCALES: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr,
               FP16: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: the pairs' rows of x times the expert's W.T columns col_begin + n0 on (gate's
    from 0, up's from N), K from k_begin to k_end."""
    P: tl.constexpr = 32 // BITS
    if PACKED_ALONG_K:
        acc = _k_packed_tile(a_ptr, qw_e, qz_e, s_e, a_rows, row_mask, stride_a, stride_w, stride_z, stride_s,
                             col_begin + n0, col_begin + N, k_begin, k_end, group_size, BITS, ZERO_OFFSET, HAS_MINS,
                             ROW_SCALES, UPCAST, PRECISION, ASM, BIASED, FP16, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _n_packed_tile(a_ptr, qw_e, qz_e, s_e, a_rows, row_mask, stride_a, stride_w, stride_z, stride_s,
                             word_begin + c0, word_begin + N // P, k_begin, k_end, group_size, BITS, AWQ_ORDER,
                             ZERO_OFFSET, HAS_MINS, UPCAST, PRECISION, ASM, BIASED, FP16, EVEN_N, BLOCK_M,
                             BLOCK_N // P, BLOCK_K)
    return acc


@triton.jit(do_not_specialize=["num_pairs", "num_tiles"])
def _moe_int_stream_kernel(
    a_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, routing_ptr, sorted_ids_ptr, tile_experts_ptr, num_padded_ptr,
    part_ptr, count_ptr, N, K, num_pairs, num_tiles, group_size,
    stride_a, stride_o, stride_we, stride_w, stride_ze, stride_z, stride_se, stride_s,
    BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr, ZERO_OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr, ROW_SCALES: tl.constexpr, ROWS_PER_A: tl.constexpr, GATED: tl.constexpr,
    WEIGHTED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr,
    FP16: tl.constexpr, EVEN_N: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """out[pair, n-block] for program_id(0) = tile * n-blocks + n-block, over the program_id(1)-th of SPLIT_K
    slices of K (whole K tiles); GATED: up's columns start at N (its words at N / P)."""
    wait_for_prior(PDL)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    tile, n_block = tl.program_id(0) // num_n_blocks, tl.program_id(0) % num_n_blocks
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    P: tl.constexpr = 32 // BITS
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    a_rows = pairs // ROWS_PER_A
    n0 = n_block * BLOCK_N
    c0 = n_block * (BLOCK_N // P)  # a product (not n0 // P): its divisibility gives 16-byte loads
    qw_e, qz_e, s_e = qw_ptr + expert * stride_we, qz_ptr + expert * stride_ze, s_ptr + expert * stride_se
    per_slice = tl.cdiv(K // BLOCK_K, SPLIT_K) * BLOCK_K
    k_begin = tl.program_id(1) * per_slice
    k_end = tl.minimum(K, k_begin + per_slice)
    acc = _pair_tile(a_ptr, qw_e, qz_e, s_e, a_rows, row_mask, stride_a, stride_w, stride_z, stride_s, n0, c0, N, 0,
                     0, k_begin, k_end, group_size, BITS, PACKED_ALONG_K, AWQ_ORDER, ZERO_OFFSET, HAS_MINS,
                     ROW_SCALES, UPCAST, PRECISION, ASM, BIASED, FP16, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc_up = acc
    if GATED:
        acc_up = _pair_tile(a_ptr, qw_e, qz_e, s_e, a_rows, row_mask, stride_a, stride_w, stride_z, stride_s, n0, c0,
                            N, N, N // P, k_begin, k_end, group_size, BITS, PACKED_ALONG_K, AWQ_ORDER, ZERO_OFFSET,
                            HAS_MINS, ROW_SCALES, UPCAST, PRECISION, ASM, BIASED, FP16, EVEN_N, BLOCK_M, BLOCK_N,
                            BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if SPLIT_K == 1:
        store_pair_rows(acc, acc_up, out_ptr, routing_ptr, pairs, row_mask, offs_n, n_mask, stride_o, GATED,
                        WEIGHTED)
    else:  # workspace [SPLIT_K, 2, num_tiles * BLOCK_M, N]
        slot = num_tiles * BLOCK_M * N
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offsets = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
        mask = row_mask[:, None] & n_mask[None, :]
        if store_split_k_slice(acc, acc_up, part_ptr, count_ptr, offsets, mask, slot, GATED, SPLIT_K):
            _sum_slices(part_ptr, out_ptr, routing_ptr, sorted_ids_ptr, tile, num_pairs, N, offs_n, n_mask,
                        stride_o, slot, GATED, WEIGHTED, SPLIT_K, BLOCK_M)


@triton.jit
def _sum_slices(part_ptr, out_ptr, routing_ptr, sorted_ids_ptr, tile, num_pairs, N, offs_n, n_mask, stride_o, slot,
                GATED: tl.constexpr, WEIGHTED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Split K's last program: each of the tile's pairs' rows, its slices added in slice order (the same sums
    whichever program is last), then the epilogue; a row at a time, as kernels/int_decode.py's (a whole tile of
    each slice live at once costs registers the K loop wants)."""
    for m in range(0, BLOCK_M):
        pair = tl.load(sorted_ids_ptr + tile * BLOCK_M + m)
        if pair < num_pairs:
            acc, acc_up = row_of_slices(part_ptr + (tile * BLOCK_M + m).to(tl.int64) * N + offs_n, n_mask, slot,
                                        GATED, SPLIT_K)
            pairs = tl.full([1], pair, tl.int32)
            store_pair_rows(acc[None, :], acc_up[None, :], out_ptr, routing_ptr, pairs, pairs < num_pairs, offs_n,
                            n_mask, stride_o, GATED, WEIGHTED)


def moe_int_stream(a: torch.Tensor, experts, out: torch.Tensor, aligned, rows_per_a: int, gated: bool,
                   routing: torch.Tensor | None, upcast: bool, precision: str) -> None:
    """One launch over the aligned tiles (`takes` must hold): out[pair] = a[pair // rows_per_a] @ W[expert].T
    (gated: silu(gate) * up; routing: times routing[pair])."""
    sorted_ids, tile_experts, num_padded = aligned
    n_total, k = experts.shape
    n = n_total // 2 if gated else n_total
    packing, group_size = experts.packing, experts.group_size or k
    cfg = stream_config(16, n, k, group_size, packing.is_packed_along_k, gated, a.dtype.itemsize, a.device,
                        packing.pack_factor)
    num_tiles, num_n_blocks = tile_experts.shape[0], cdiv(n, cfg["BLOCK_N"])
    # the tiles that hold pairs: one for each expert a pair chose, and one more for each 16 pairs of an expert
    num_pairs = out.shape[0]
    busy = min(num_tiles, min(num_pairs, experts.num_experts) + num_pairs // 16) * num_n_blocks
    split = split_k(busy, k // cfg["BLOCK_K"], a.device)
    counts = split_counts(a.device, num_tiles * num_n_blocks, owner="moe_int") if split > 1 else None
    if counts is None:
        split = 1
    parts = (torch.empty(split, 2, num_tiles * 16, n, dtype=torch.float32, device=a.device) if split > 1 else out)
    has_mins, row_scales = experts.mins is not None, group_size < cfg["BLOCK_K"]
    zeros = experts.mins if has_mins else experts.qzeros  # the kernel's qz_ptr holds either
    biased = PAIR_UNPACK and can_pair_unpack(packing, a.dtype, has_mins) and not row_scales
    _moe_int_stream_kernel[(num_tiles * num_n_blocks, split)](
        a, experts.qweight, zeros, experts.scales, out, out if routing is None else routing, sorted_ids,
        tile_experts, num_padded, parts, counts if counts is not None else sorted_ids, n, k, out.shape[0],
        num_tiles, group_size, a.stride(0), out.stride(0), experts.qweight.stride(0), experts.qweight.stride(1),
        zeros.stride(0), zeros.stride(1), experts.scales.stride(0), experts.scales.stride(1),
        BITS=packing.bits, PACKED_ALONG_K=packing.is_packed_along_k, AWQ_ORDER=packing.fields is not None,
        ZERO_OFFSET=packing.zero_offset, HAS_MINS=has_mins, ROW_SCALES=row_scales, ROWS_PER_A=rows_per_a,
        GATED=gated, WEIGHTED=routing is not None,
        UPCAST=upcast, PRECISION=precision, ASM=not is_interpreting(), BIASED=biased,
        FP16=a.dtype == torch.float16, EVEN_N=n % cfg["BLOCK_N"] == 0, SPLIT_K=split, BLOCK_M=16,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], **pdl_options(a.device), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
