"""Weight-only integer linear layers (W4A16, W8A16): AWQ and GPTQ weights as their checkpoints store them,
dequantized on the fly.

    AWQ (AutoAWQ, version "gemm")                   GPTQ v1 (AutoGPTQ, GPTQModel); `offset_binary`:
                                                    the same, zeros stored as they are
    qweight int32 [K, N / 8]: 8 columns an int32    qweight int32 [K / p, N]: p = 32 / bits rows an int32,
            column j of each 8 in nibble                    row j of each p in field j (bits * j)
            AWQ_FIELDS[j] (AutoAWQ packs in the
            order 0 2 4 6 1 3 5 7)
    qzeros  int32 [G, N / 8]: as qweight's columns  qzeros  int32 [G, N / p]: columns in fields 0.., each
                                                            stored as zero - 1 (v1's off-by-one)
    scales  fp16  [G, N]                            scales  fp16  [G, N]
    group of input feature k: k // group_size       g_idx   int32 [K]: input feature k's group (act-order)

    W[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]        y = x @ W.T
    or, with `mins` [G, N] in place of qzeros (GGUF Q4_1 / Q5_1 / Q4_K / Q5_K):  W[n, k] = q * scale + min
    (scales and mins fp16, bf16 or float32; GGUF's groups of 16 or 32: checkpoints/gguf_types.py)

`dequantize_ref` writes W [N, K] in the activations' dtype (computed in float32: (q - zero) * scale is exact there
for fp16 scales), and `linear_int_ref` hands it to `kernels.linear.linear`, so an int layer computes what an
unquantized layer holding the dequantized weight computes, bit for bit. The weight is dequantized per call and
dropped: the layer holds only the packed tensors.

On a GPU, one Triton kernel (`_int_linear_kernel`) never writes W: each program owns a [BLOCK_M, BLOCK_N] tile
of the output, walks K, and unpacks and dequantizes each [BLOCK_K, BLOCK_N] tile of integers in registers
(kernels/int_tiles.py: the same float32 arithmetic, rounded to x's dtype) before its tl.dot on the tensor cores;
the gated SiLU-and-mul epilogue is kernels/linear.py's. Two families of launch settings:

    rows <= MAX_ROWS (decode)   `decode_config`: one row tile (x padded to 16 rows), narrow column tiles streaming
                                all of K, each value loading its own word; only for the layouts that
                                kernels/int_decode.py's streaming kernel does not take (`can_stream`: act-order,
                                K tiles across groups), which `linear_int_triton` runs otherwise
    more rows (GEMM)            `gemm_config`: row tiles of 32-128 in grouped order (a column tile's weights stay
                                in L2 while GROUP_M row tiles use them), each packed word loaded once

A tile inside one group (no g_idx, BLOCK_K dividing group_size) reads one row of zeros and scales; otherwise
(act-order, groups of 32 under 64-wide tiles) it gathers them per element (cached reads, not streamed ones).

`linear_int_dequantized` instead writes W once into a scratch of x's dtype (`_int_dequantize_kernel`, the
reference's values exactly) and hands it to cuBLAS. `linear_int` takes it for every call the streaming decode kernel
(kernels/int_decode.py: up to STREAM_MAX_ROWS rows of the layouts it takes) does not, from DEQUANTIZE_MIN_ROWS rows: on
the H200 (`python -m benchmarks.kernels --only int4`, benchmarks/results/h200-kernels-int4-first.txt) it was faster
than this kernel's tiles at every size measured, on each of Llama-3-8B's and 70B's linears: 7-28x the decode tiles
at 1-16 rows, 1.1-4.5x the GEMM tiles at 32-2048 rows. The tiles stay for callers that ask for them
(`dequantize_min_rows`, `linear_int_triton`'s config), and their PAIRS path (4-bit AWQ order, exact q - z in 16-bit
pairs: `pair_tiles`) serves STREAM_MAX_ROWS + 1 to PAIR_GEMM_MAX_ROWS rows, where an H100 timed it faster.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    num_sms,
    pdl_options,
    shared_memory_per_block,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.int_decode import can_stream, has_row_scales, linear_int_stream
from kernels.int_tiles import awq_columns_tile, rounded_tile_dot, weight_tile
from kernels.linear import MAX_ROWS, linear, linear_cublas, store_output

# From this many rows on, a call neither the streaming kernel nor the PAIRS tiles take dequantizes W into a scratch
# and runs cuBLAS instead of the Triton kernel's tiles: from the first, as the H200 measured (the docstring). A
# `linear_int` argument: callers may choose (vLLM's AWQ takes cuBLAS from 256 rows).
DEQUANTIZE_MIN_ROWS = 1
# Rows the streaming kernel takes in `linear_int` and `linear_int_triton` (past MAX_ROWS in row tiles of 16, K
# split over all of them: kernels/int_decode.py). On an H100 (2026-12-07, `python -m benchmarks.kernels --only int4
# --tune --int-rows 32 64`, benchmarks/results/h100-kernels-tune-int4-row-tiles-split.json) they took 0.21-0.49x
# dequantize + cuBLAS's time on each of Llama-3-8B's and 70B's AWQ linears at 32 rows and 0.40-0.76x at 64 (0.55-2.0x
# bf16 cuBLAS's), and 8B AWQ decode went from 14.6 / 14.9 to 5.3 / 7.9 ms a step at batch 32 / 64 (h100-latency-llama3-
# 8b-awq-rows-{off,tile16-all}.json). Each row tile unpacks the words again, so the time grows with the rows: past
# 64 (not measured between 64 and 256, where dequantize + cuBLAS was the faster) the dequantizing path.
STREAM_MAX_ROWS = 64
# The GEMM tiles' 4-bit AWQ-order path (`pair_tiles`): 16-byte tiles of q - z unpacked from each word, the scale on
# the dot (sm_90 SASS of 8B's AWQ linears at 128-2048 rows, compiled here: 1.83-2.02 warp instructions a thousand
# multiply-adds in the K loop at `pair_gemm_config`'s tiles, against 2.7-5.4 for the float path).
PAIR_GEMM = True
# Past STREAM_MAX_ROWS up to this many rows, `linear_int` runs the PAIRS tiles (`pair_gemm_config`) where `pair_tiles`
# takes the layer, instead of dequantize + cuBLAS; read at each call (a benchmark process may set it). On an H100
# (2026-12-07, benchmarks/results/h100-kernels-int4-awq-pairs.json) at 128 rows they took 0.64-0.87x dequantize +
# cuBLAS's time on 8B's qkv and gate_up and 70B's o, gate_up and down, 1.06x on 70B's qkv, 1.24x on 8B's o and down
# (64 programs: half the SMs): 0.89x over 8B's four, 0.71x over 70B's; at 256 rows 1.09-1.53x on all eight. 8B AWQ
# decode at batch 128 took 14.12 ms a step against 15.84 (h100-latency-llama3-8b-awq-pairs-{128,off}.json). Not
# measured between 64 and 128 rows or 128 and 256, nor on an H200.
PAIR_GEMM_MAX_ROWS = 128
GEMM_ROW_TILES = (32, 64, 128)  # gemm_config's BLOCK_M: the smallest that holds the rows, else the largest
AWQ_FIELDS = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 sits in nibble AWQ_FIELDS[j]: packed in order 0 2 4 6 1 3 5 7


@dataclass(frozen=True)
class IntPacking:
    """How a scheme packs its integers in int32: `bits` each; qweight packed along K (GPTQ) or along N (AWQ);
    `fields[j]`: which field holds value j of each int32 (None: field j); qzeros are packed along N, with the
    same fields, holding zero - `zero_offset`."""

    bits: int
    is_packed_along_k: bool
    fields: tuple[int, ...] | None
    zero_offset: int

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits


AWQ_GEMM = IntPacking(bits=4, is_packed_along_k=False, fields=AWQ_FIELDS, zero_offset=0)


def gptq_v1(bits: int) -> IntPacking:
    return IntPacking(bits=bits, is_packed_along_k=True, fields=None, zero_offset=1)


def offset_binary(bits: int) -> IntPacking:
    """Signed integers stored as q + 2^(bits - 1), packed along K in order (compressed-tensors' pack_to_int32,
    GGUF blocks repacked at load), zero points as stored: GPTQ's layout without v1's off-by-one (GPTQ v2's)."""
    return IntPacking(bits=bits, is_packed_along_k=True, fields=None, zero_offset=0)


def unpack_int32(packed: torch.Tensor, bits: int, along_rows: bool, fields: tuple[int, ...] | None = None):
    """packed int32 [R, C] -> int32 [R * p, C] (along_rows) or [R, C * p]: value j of each int32 from field
    fields[j] (bits * fields[j] up), unsigned."""
    p = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if fields is not None:
        shifts = shifts[list(fields)]
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, p]; the mask undoes the sign extension
    rows, cols = packed.shape
    if along_rows:
        return values.permute(0, 2, 1).reshape(rows * p, cols)
    return values.reshape(rows, cols * p)


def unpack_weight(qweight: torch.Tensor, packing: IntPacking) -> torch.Tensor:
    """The integers of qweight, int32 [K, N]."""
    return unpack_int32(qweight, packing.bits, packing.is_packed_along_k, packing.fields)


def unpack_zeros(qzeros: torch.Tensor, packing: IntPacking) -> torch.Tensor:
    """The zero points, int32 [G, N] (GPTQ v1's stored value + 1)."""
    return unpack_int32(qzeros, packing.bits, False, packing.fields) + packing.zero_offset


def pack_int32(values: torch.Tensor, bits: int, along_rows: bool,
               fields: tuple[int, ...] | None = None) -> torch.Tensor:
    """`unpack_int32`'s inverse: unsigned integers (< 2^bits) [R * p, C] (along_rows) or [R, C * p] -> int32
    [R, C], value j of each p in field fields[j] (None: field j)."""
    p = 32 // bits
    shifts = bits * torch.tensor(fields if fields is not None else range(p), dtype=torch.int64, device=values.device)
    v = values.to(torch.int64)
    v = v.reshape(-1, p, v.shape[1]).transpose(1, 2) if along_rows else v.reshape(v.shape[0], -1, p)  # [R, C, p]
    words = (v << shifts).sum(-1)  # < 2^32
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits as int32


def along_n(qweight: torch.Tensor, qzeros: torch.Tensor, packing: IntPacking,
            rows_at_once: int = 64) -> tuple[torch.Tensor, torch.Tensor, IntPacking]:
    """A 4-bit layer packed along K (GPTQ's, compressed-tensors' layout) as the same integers packed along N in
    AWQ's order: (qweight [K, N / 8], qzeros [G, N / 8], packing), zero points stored as before (v1's zero - 1 and
    its zero_offset kept). The weights are the same exactly. `rows_at_once` word rows are unpacked at a time (a few
    hundred MB of int64 temporaries for a 70B layer's 57,344 columns)."""
    assert packing.bits == 4 and packing.is_packed_along_k and packing.fields is None, packing
    out = torch.empty(qweight.shape[0] * 8, qweight.shape[1] // 8, dtype=torch.int32, device=qweight.device)
    for r in range(0, qweight.shape[0], rows_at_once):
        out[8 * r:8 * (r + rows_at_once)] = pack_int32(unpack_weight(qweight[r:r + rows_at_once], packing), 4, False,
                                                       AWQ_FIELDS)
    zeros = pack_int32(unpack_int32(qzeros, 4, False), 4, False, AWQ_FIELDS)
    return out, zeros, IntPacking(bits=4, is_packed_along_k=False, fields=AWQ_FIELDS, zero_offset=packing.zero_offset)


def sorted_by_group(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    group_size: int, packing: IntPacking, columns_at_once: int = 1024):
    """An act-order layer packed along K (g_idx in any order) as a layer without one: its input features sorted by
    group, (perm, qweight, qzeros, scales), where x[:, perm] @ the new W.T equals x @ W.T (the same weights, their
    K in perm's order) and feature k of the new layer is in group k // group_size. None where the sorted features
    are not whole groups (a row-parallel rank holding part of some groups)."""
    assert packing.is_packed_along_k, packing
    g = g_idx.long()
    perm = torch.argsort(g, stable=True)
    ordered = g[perm]
    if ordered.numel() % group_size:
        return None
    groups = ordered[::group_size]
    if not torch.equal(ordered, groups.repeat_interleave(group_size)):
        return None
    words = torch.empty_like(qweight)
    for c in range(0, qweight.shape[1], columns_at_once):
        q = unpack_weight(qweight[:, c:c + columns_at_once], packing)[perm]
        words[:, c:c + columns_at_once] = pack_int32(q, packing.bits, True, packing.fields)
    return perm, words, qzeros[groups], scales[groups]


def group_index(num_in_features: int, group_size: int | None, device) -> torch.Tensor:
    """Each input feature's group when there is no g_idx: k // group_size (None: one group)."""
    k = torch.arange(num_in_features, dtype=torch.int32, device=device)
    return k // group_size if group_size is not None else torch.zeros_like(k)


def dequantize_ref(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, group_size: int | None, packing: IntPacking, dtype: torch.dtype,
                   mins: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in `dtype` (see the module docstring); g_idx None: k // group_size. `mins` [G, N] (GGUF) instead
    of zero points: W = q * scale + min, rounded once in float32 as gguf's dequantization rounds it."""
    q = unpack_weight(qweight, packing)  # [K, N]
    groups = (g_idx if g_idx is not None else group_index(q.shape[0], group_size, q.device)).long()  # [K]
    if mins is not None:
        assert mins.shape == scales.shape, f"mins {tuple(mins.shape)} and scales {tuple(scales.shape)} differ"
        w = q.float() * scales[groups].float() + mins[groups].float()  # [K, N]
        return w.t().contiguous().to(dtype)
    assert qzeros is not None, "zero points or mins"
    zeros = unpack_zeros(qzeros, packing)  # [G, N]
    assert zeros.shape == scales.shape, f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} differ"
    w = (q - zeros[groups]).float() * scales[groups].float()  # [K, N], exact in float32
    return w.t().contiguous().to(dtype)


def linear_int_ref(x: torch.Tensor, qweight, qzeros, scales, g_idx, group_size: int | None, packing: IntPacking,
                   bias: torch.Tensor | None = None, gated: bool = False, mins=None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) -> [T, N] (gated: silu(gate) * up, [T, N / 2]), W dequantized for this call."""
    weight = dequantize_ref(qweight, qzeros, scales, g_idx, group_size, packing, x.dtype, mins)
    return linear(x, weight, bias, gated)


def linear_int(x: torch.Tensor, qweight, qzeros, scales, g_idx, group_size: int | None, packing: IntPacking,
               bias: torch.Tensor | None = None, gated: bool = False, mins=None,
               dequantize_min_rows: int = DEQUANTIZE_MIN_ROWS) -> torch.Tensor:
    """`linear_int_ref`'s result. On a GPU: the streaming kernel for up to STREAM_MAX_ROWS rows of a layout it takes
    (`can_stream`) well (not groups under its K tile with zero points); otherwise `linear_int_dequantized` from
    `dequantize_min_rows` rows, the Triton kernel's tiles below (decode tiles up to MAX_ROWS, GEMM tiles above),
    except the PAIRS tiles up to PAIR_GEMM_MAX_ROWS rows where they take the layer; elsewhere the reference."""
    if not use_triton(x):
        return linear_int_ref(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins)
    n = qweight.shape[1] if packing.is_packed_along_k else qweight.shape[1] * packing.pack_factor
    group = group_size or x.shape[1]
    # Groups under the stream's K tile with zero points (GPTQ's 32, GGUF's Q4_0 / Q5_0 / Q8_0 / Q6_K) stream no
    # faster than dequantize + cuBLAS: on an H100 (2026-12-07, benchmarks/results/h100-kernels-int4-row-scales*.json)
    # GPTQ g32's stream read 0.25-0.33 TB/s, 1.0-1.2x dequantize + cuBLAS's time. With mins (Q4_K, Q4_1, ...) it
    # reads 0.8-1.3 TB/s, a third of dequantize + cuBLAS's time.
    slow_stream = has_row_scales(packing.is_packed_along_k, group, packing.pack_factor) and mins is None
    out_features = n // 2 if gated else n
    pairs = (layer_pair_config(x.shape[0], out_features, gated, group, packing, g_idx, x.dtype, mins, x.device)
             if STREAM_MAX_ROWS < x.shape[0] <= PAIR_GEMM_MAX_ROWS else None)
    if pairs is not None:
        return linear_int_triton(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, pairs, mins)
    if ((slow_stream or not can_stream(packing, g_idx, group, x.shape[1], out_features, x.shape[0], STREAM_MAX_ROWS))
            and x.shape[0] >= dequantize_min_rows):
        return linear_int_dequantized(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins)
    return linear_int_triton(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins=mins)


@triton.jit
def _tile_of(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid, in groups of GROUP_M row tiles that take each column tile in turn:
    programs running together share a column tile's weights (in L2) and GROUP_M row tiles of x."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit(do_not_specialize=["M"])  # a batch's rows pick no new variant (1 and multiples of 16 would)
def _int_linear_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, M, N, K, group_size,
    stride_x, stride_qw, stride_qz, stride_s, stride_o, up_col,
    ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr,
    HAS_G_IDX: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, UNPACK_ONCE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
    PAIRS: tl.constexpr = False, FP16: tl.constexpr = False, ASM: tl.constexpr = False,
):
    """PAIRS (4-bit AWQ order along N, zero points, a K tile in one group, 16-bit x; `pair_tiles`): each word
    unpacked into 8 columns of q - z by `int_tiles.awq_columns_tile`, exact, and the group's scale applied to the
    tile's dot; otherwise `weight_tile`'s (q - z) * scale rounded to x's dtype, as the reference."""
    wait_for_prior(PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    n0 = pid_n * BLOCK_N
    offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_mask = ks < K
        xv = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                     other=0.0)
        if PAIRS:
            acc += _pair_tile_dot(xv, qw_ptr, qz_ptr, s_ptr, k0, ks, k_mask, n0, n_mask, N, stride_qw, stride_qz,
                                  stride_s, group_size, ZERO_OFFSET, UPCAST, PRECISION, FP16, ASM, BLOCK_K, BLOCK_N)
            if GATED:
                acc_up += _pair_tile_dot(xv, qw_ptr, qz_ptr, s_ptr, k0, ks, k_mask, up_col + n0, n_mask, up_col + N,
                                         stride_qw, stride_qz, stride_s, group_size, ZERO_OFFSET, UPCAST, PRECISION,
                                         FP16, ASM, BLOCK_K, BLOCK_N)
        else:  # W rounded to x's dtype, as the reference rounds it
            acc += rounded_tile_dot(xv, qw_ptr, qz_ptr, s_ptr, g_ptr, k0, ks, k_mask, n0, offs_n, n_mask, N, K,
                                    stride_qw, stride_qz, stride_s, group_size, ZERO_OFFSET, BITS, PACKED_ALONG_K,
                                    AWQ_ORDER, HAS_G_IDX, ONE_GROUP, HAS_MINS, UNPACK_ONCE, UPCAST, PRECISION,
                                    BLOCK_K, BLOCK_N)
            if GATED:
                acc_up += rounded_tile_dot(xv, qw_ptr, qz_ptr, s_ptr, g_ptr, k0, ks, k_mask, up_col + n0,
                                           up_col + offs_n, n_mask, up_col + N, K, stride_qw, stride_qz, stride_s,
                                           group_size, ZERO_OFFSET, BITS, PACKED_ALONG_K, AWQ_ORDER, HAS_G_IDX,
                                           ONE_GROUP, HAS_MINS, UNPACK_ONCE, UPCAST, PRECISION, BLOCK_K, BLOCK_N)
    store_output(acc, acc_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_col, HAS_BIAS, GATED)


@triton.jit
def _pair_tile_dot(xv, qw_ptr, qz_ptr, s_ptr, k0, ks, k_mask, n0, n_mask, n_end, stride_qw, stride_qz, stride_s,
                   group_size, ZERO_OFFSET: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   FP16: tl.constexpr, ASM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """x's tile times the [BLOCK_K, BLOCK_N] tile of W.T at columns n0 + arange(BLOCK_N) (below n_end, a multiple
    of 8, as n0), float32: x against q - z (exact), times the group's scales."""
    pcol = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    pcol_mask = pcol < n_end // 8
    words = tl.load(qw_ptr + ks[:, None] * stride_qw + pcol[None, :], mask=k_mask[:, None] & pcol_mask[None, :],
                    other=0)
    group = k0 // group_size
    zero_words = tl.load(qz_ptr + group * stride_qz + pcol, mask=pcol_mask, other=0)
    w = awq_columns_tile(words, zero_words, ZERO_OFFSET, FP16, ASM)
    if UPCAST:
        xv = xv.to(tl.float32)
        w = w.to(tl.float32)
    cols = n0 + tl.arange(0, BLOCK_N)
    scale = tl.load(s_ptr + group * stride_s + cols, mask=n_mask, other=0.0).to(tl.float32)
    return tl.dot(xv, w, input_precision=PRECISION) * scale[None, :]


def pair_tiles(packing: IntPacking, g_idx, group_size: int, block_k: int, block_n: int, dtype: torch.dtype, mins,
               unpack_once: bool) -> bool:
    """Whether `_int_linear_kernel` takes its PAIRS path: 4 bits along N in AWQ's order with zero points (AWQ, and
    GPTQ / pack-quantized as held along N), no g_idx, each K tile in one group, whole words, 16-bit x
    (whose dtype holds q - z exactly; float32 x keeps the reference's rounding), and column tiles of 64 or more
    (Triton 3.9 failed to compile 64 x 32 x 128 tiles of it for sm_90, "Illegal shared layout"; 32 columns make
    4-word rows, a poor shared-memory operand anyway)."""
    return (PAIR_GEMM and packing.bits == 4 and not packing.is_packed_along_k and packing.fields == AWQ_FIELDS
            and mins is None and g_idx is None and group_size % block_k == 0 and block_n >= 64 and unpack_once
            and dtype in (torch.bfloat16, torch.float16))


def pair_gemm_config(num_rows: int, out_features: int, gated: bool, group_size: int, device: torch.device) -> dict:
    """Launch settings for the PAIRS path: row tiles of 64 or 128 (wgmma's), K tiles of a group up to 128 (the
    scale's multiply-adds, one a tile's output a K tile, are fewer a product the longer the tile), 128 or 64
    columns (gated 64) while they give every SM a program, 8 warps from 128 columns (a gated tile's two halves
    count: a gated 64 x 64 at 4 spilled, a plain 128 x 64 at 8 took 1.5x the instructions), and as many stages
    (2-4) as shared memory holds. In the sm_90 SASS of 8B's linears at 128-2048 rows: 1.8-2.0 warp instructions a
    thousand products (the float path: 2.7-5.4); timed on an H100 (PAIR_GEMM_MAX_ROWS)."""
    block_m = 64 if num_rows <= 64 else 128
    block_k = 128 if group_size % 128 == 0 else 64
    tiles_m = cdiv(num_rows, block_m)
    block_n = 128 if not gated and tiles_m * cdiv(out_features, 128) >= num_sms(device) else 64
    halves = 2 if gated else 1
    limit = shared_memory_per_block(device)
    stages = 4
    while stages > 2 and stages * (block_m * block_k * 2 + halves * block_k * block_n // 2) > limit:
        stages -= 1
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8,
            "num_warps": 8 if block_n * halves >= 128 else 4, "num_stages": stages,
            "UNPACK_ONCE": True, "PAIRS": True}


def layer_pair_config(num_rows: int, out_features: int, gated: bool, group_size: int, packing: IntPacking, g_idx,
                      dtype: torch.dtype, mins, device: torch.device) -> dict | None:
    """`pair_gemm_config`'s settings for this layer where `pair_tiles` takes it at them (whole words a column tile:
    out_features a multiple of 8), else None."""
    cfg = pair_gemm_config(num_rows, out_features, gated, group_size, device)
    takes = pair_tiles(packing, g_idx, group_size, cfg["BLOCK_K"], cfg["BLOCK_N"], dtype, mins,
                       out_features % packing.pack_factor == 0)
    return cfg if takes else None


def _packed_shape(qweight, qzeros, scales, g_idx, group_size, packing: IntPacking, mins) -> tuple[int, int]:
    """(K, N) of the packed weight, after checking the packed tensors' shapes and dtypes against each other."""
    if (qzeros is None) == (mins is None):
        raise ValueError("give qzeros or mins, not both or neither")
    ints = (("qweight", qweight),) + ((("qzeros", qzeros),) if qzeros is not None else ())
    for name, t in ints + ((("g_idx", g_idx),) if g_idx is not None else ()):
        check_dtype(name, t, (torch.int32,))
    check_dtype("scales", scales, FLOAT_DTYPES)
    p = packing.pack_factor
    k, n = (qweight.shape[0] * p, qweight.shape[1]) if packing.is_packed_along_k else (qweight.shape[0],
                                                                                        qweight.shape[1] * p)
    if mins is not None:
        check_dtype("mins", mins, FLOAT_DTYPES)
        if mins.shape != scales.shape:
            raise ValueError(f"mins {tuple(mins.shape)} and scales {tuple(scales.shape)} differ")
    if scales.shape[1] != n or (qzeros is not None and qzeros.shape != (scales.shape[0], n // p)):
        raise ValueError(f"scales {tuple(scales.shape)} and qzeros {tuple(qzeros.shape)} do not fit N = {n}")
    if g_idx is None and (k // (group_size or k)) != scales.shape[0]:
        raise ValueError(f"{scales.shape[0]} groups of scales, {k} input features in groups of {group_size}")
    if g_idx is not None and g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
    return k, n


def _check_int_inputs(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated,
                      mins=None) -> tuple[int, int]:
    """(K, N) of the packed weight, after checking every shape and dtype against x's."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    k, n = _packed_shape(qweight, qzeros, scales, g_idx, group_size, packing, mins)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} input features, the packed weight {k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if gated and n % 2:
        raise ValueError(f"a gated weight stacks gate and up columns: an even count, got {n}")
    return k, n


def _check_packed_launchable(qweight, qzeros, scales, g_idx, mins, *others) -> torch.Tensor:
    """The zero points' or mins' tensor (the kernels read one or the other through qz_ptr), after checking that
    a kernel can read all of them."""
    zero_term = mins if mins is not None else qzeros
    check_launchable(*[t for t in (*others, qweight, zero_term, scales, g_idx) if t is not None])
    for name, t in (("qweight", qweight), ("qzeros" if mins is None else "mins", zero_term), ("scales", scales)):
        check_last_dim_contiguous(name, t)
    return zero_term


def decode_config(num_rows: int) -> dict:
    """Launch settings for a few rows: one row tile (x padded to tl.dot's 16 rows), narrow column tiles streaming
    all of K (a first version, not yet tuned on a GPU)."""
    return {"BLOCK_M": max(16, next_power_of_2(num_rows)), "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1,
            "num_warps": 4, "num_stages": 2, "UNPACK_ONCE": False}


@functools.lru_cache(maxsize=None)
def gemm_config(num_rows: int, out_features: int, gated: bool, dtype: torch.dtype, device: torch.device) -> dict:
    """Launch settings for more rows: row tiles of 32-128 (GEMM_ROW_TILES), the widest column tiles that still give
    a program to every SM (gated: half as wide, for its two accumulators), each word of the packed tile loaded once.
    Stages shrink until x's tiles and the packed words fit in shared memory beside the dequantized tiles. A first
    choice, to be set from `python -m benchmarks.kernels --only int4`."""
    block_m = next(m for m in GEMM_ROW_TILES if num_rows <= m or m == GEMM_ROW_TILES[-1])
    widths = (64, 32) if gated else (128, 64, 32)
    tiles_m = cdiv(num_rows, block_m)
    block_n = next((n for n in widths if tiles_m * cdiv(out_features, n) >= num_sms(device)), widths[-1])
    block_k = 64 if block_m == 128 else 128
    stages, size, halves = 4, dtype.itemsize, 2 if gated else 1
    limit = shared_memory_per_block(device)
    while stages > 2 and (stages * (block_m * size + halves * block_n) * block_k
                          + halves * block_k * block_n * size > limit):
        stages -= 1
    # 8 warps where the accumulators or the float32 dequantized tiles (registers) reach 128 x 128 values
    warps = 8 if max(block_m, block_k) * block_n * halves >= 128 * 128 else 4
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, "UNPACK_ONCE": True}


def float32_tiles(cfg: dict, gated: bool) -> dict:
    """Tiles for float32 x on a GPU (the GPU oracle tests'): its dot, in float32 without tensor cores, keeps its
    operands in shared memory and registers at 4 bytes a value: 16-bit tiles overflowed shared memory (245-1,441
    KB against the H200's 227) and spilled registers. Not under the interpreter, whose tests run every config."""
    block_m = min(cfg["BLOCK_M"], 64)
    return {"BLOCK_M": block_m, "BLOCK_N": min(cfg["BLOCK_N"], 128 if not gated else 64),
            "BLOCK_K": min(cfg["BLOCK_K"], 16), "num_stages": 1, "num_warps": 8 if block_m == 64 else cfg["num_warps"]}


def linear_int_triton(x, qweight, qzeros, scales, g_idx, group_size: int | None, packing: IntPacking,
                      bias=None, gated: bool = False, config: dict | None = None, mins=None) -> torch.Tensor:
    """Triton launcher of `linear_int` (any number of rows); `mins` in place of qzeros. Up to STREAM_MAX_ROWS rows of a
    layout `int_decode.can_stream` takes, without `config`: the streaming kernel (kernels/int_decode.py). Else
    `_int_linear_kernel`, its settings `config` over `decode_config` (up to MAX_ROWS rows) or `gemm_config`."""
    k, n = _check_int_inputs(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins)
    zero_term = _check_packed_launchable(qweight, qzeros, scales, g_idx, mins, x, bias)
    check_last_dim_contiguous("x", x)
    num_rows, out_features = x.shape[0], n // 2 if gated else n
    if (config is None and num_rows > 0 and out_features > 0
            and can_stream(packing, g_idx, group_size or k, k, out_features, num_rows, STREAM_MAX_ROWS)):
        return linear_int_stream(x, qweight, zero_term, scales, group_size or k, packing, bias, gated,
                                 mins is not None, upcast_dot_operands(x.dtype, x.device), dot_precision(x.dtype))
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out
    default = (decode_config(num_rows) if num_rows <= MAX_ROWS
               else gemm_config(num_rows, out_features, gated, x.dtype, x.device))
    cfg = {**default, **(config or {})}
    if x.dtype == torch.float32 and not is_interpreting():
        cfg |= float32_tiles(cfg, gated)
    p = packing.pack_factor
    # whole words: AWQ's up half starts on one (and every tile does: BLOCK_N, BLOCK_K are multiples of p)
    unpack_once = cfg["UNPACK_ONCE"] and (packing.is_packed_along_k or out_features % p == 0)
    grid = (cdiv(num_rows, cfg["BLOCK_M"]) * cdiv(out_features, cfg["BLOCK_N"]),)
    _int_linear_kernel[grid](
        x, qweight, zero_term, scales, g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales, out, num_rows, out_features, k, group_size or k,
        x.stride(0), qweight.stride(0), zero_term.stride(0), scales.stride(0), out.stride(0), out_features,
        **_layout_args(packing, g_idx, group_size or k, cfg["BLOCK_K"], mins),
        HAS_BIAS=bias is not None, GATED=gated,
        UPCAST=upcast_dot_operands(x.dtype, x.device), PRECISION=dot_precision(x.dtype), UNPACK_ONCE=unpack_once,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        PAIRS=cfg.get("PAIRS", True) and pair_tiles(packing, g_idx, group_size or k, cfg["BLOCK_K"], cfg["BLOCK_N"],
                                                     x.dtype, mins, unpack_once),
        FP16=x.dtype == torch.float16, ASM=not is_interpreting(),
        **pdl_options(x.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _layout_args(packing: IntPacking, g_idx, group_size: int, block_k: int, mins) -> dict:
    """The constexprs that say how the packed tensors are laid out (int_tiles.weight_tile's)."""
    assert block_k % packing.pack_factor == 0, f"BLOCK_K {block_k}: a multiple of {packing.pack_factor}"
    return dict(ZERO_OFFSET=packing.zero_offset, BITS=packing.bits, PACKED_ALONG_K=packing.is_packed_along_k,
                AWQ_ORDER=packing.fields is not None, HAS_G_IDX=g_idx is not None,
                ONE_GROUP=g_idx is None and group_size % block_k == 0, HAS_MINS=mins is not None)


@triton.jit
def _int_dequantize_kernel(
    qw_ptr, qz_ptr, s_ptr, g_ptr, out_ptr, N, K, group_size, stride_qw, stride_qz, stride_s, stride_o,
    ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr,
    HAS_G_IDX: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """W [N, K] in out's dtype, a [BLOCK_K, BLOCK_N] tile of W.T a program."""
    wait_for_prior(PDL)
    k0 = tl.program_id(0) * BLOCK_K
    n0 = tl.program_id(1) * BLOCK_N
    ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
    k_mask = ks < K
    cols = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = cols < N
    w = weight_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, ks, k_mask, n0, cols, n_mask, N, K, stride_qw, stride_qz,
                    stride_s, group_size, ZERO_OFFSET, BITS, PACKED_ALONG_K, AWQ_ORDER, HAS_G_IDX, ONE_GROUP,
                    HAS_MINS, True, BLOCK_K, BLOCK_N)
    tl.store(out_ptr + cols[None, :] * stride_o + ks[:, None], w.to(out_ptr.dtype.element_ty),
             mask=k_mask[:, None] & n_mask[None, :])


def dequantize_triton(qweight, qzeros, scales, g_idx, group_size: int | None, packing: IntPacking,
                      dtype: torch.dtype, mins=None, config: dict | None = None) -> torch.Tensor:
    """`dequantize_ref`'s W [N, K] in `dtype`, written by one Triton kernel (each packed word read once)."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
    k, n = _packed_shape(qweight, qzeros, scales, g_idx, group_size, packing, mins)
    zero_term = _check_packed_launchable(qweight, qzeros, scales, g_idx, mins)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    cfg = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, **(config or {})}
    _int_dequantize_kernel[(cdiv(k, cfg["BLOCK_K"]), cdiv(n, cfg["BLOCK_N"]))](
        qweight, zero_term, scales, g_idx if g_idx is not None else qweight, out, n, k, group_size or k,
        qweight.stride(0), zero_term.stride(0), scales.stride(0), out.stride(0),
        **_layout_args(packing, g_idx, group_size or k, cfg["BLOCK_K"], mins),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], **pdl_options(qweight.device), num_warps=cfg["num_warps"],
    )
    return out


def linear_int_dequantized(x, qweight, qzeros, scales, g_idx, group_size: int | None, packing: IntPacking,
                           bias=None, gated: bool = False, mins=None) -> torch.Tensor:
    """`linear_int` for many rows: W dequantized into a scratch of x's dtype (`dequantize_triton`), then cuBLAS
    (and silu_and_mul when gated), as `linear_int_ref` but with W written by one kernel."""
    _check_int_inputs(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins)
    weight = dequantize_triton(qweight, qzeros, scales, g_idx, group_size, packing, x.dtype, mins)
    return linear_cublas(x, weight, bias, gated)
