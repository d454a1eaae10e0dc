"""Fused mixture of experts over quantized expert weights: kernels/moe.py's grouped GEMMs (the same routing, expert
alignment, SiLU-and-mul and combine) over int or FP8 experts.

    IntExperts   W4A16 / W8A16: one projection's experts stacked, each as kernels/linear_int.py holds an int
                 layer (AWQ, GPTQ v1, compressed-tensors' offset binary; its `IntPacking`):
                     qweight int32 [E, K, N / 8] (AWQ) or [E, K / p, N]    qzeros int32 [E, G, N / p]
                     scales [E, G, N]                                       g_idx int32 [E, K] (act-order) or none
                 or, for GGUF's blocks (Q4_1, Q5_1, Q4_K, Q5_K), mins [E, G, N] in place of qzeros: w = q * scale
                 + min (kernels/linear_int.py; the two projections of a layer may be of different types)
    Fp8Experts   W8A8: weight e4m3 [E, N, K]; scale float32 [E, N] (a scale per output row), or a scale per
                 block of block_size (bn, bk): [E, parts * ceil(N_part / bn), ceil(K / bk)], where `parts` 2 says
                 the rows are gate's then up's (N_part = N / 2 each) with their own blocks (a tensor-parallel rank's
                 gate rows need not fill whole blocks)

Int experts (W4A16 / W8A16): each [BLOCK_K, BLOCK_N] weight tile is dequantized in registers (kernels/int_tiles.py's
`rounded_tile_dot`: `weight_tile`, float32, rounded to x's dtype) before its tl.dot with x's tile;
`fused_moe_quant_ref` is `kernels.moe.fused_moe_ref` over the dequantized weights (W[e] =
kernels.linear_int.dequantize_ref(expert e) in x's dtype), so both compute what an unquantized model holding the
dequantized weights computes.

FP8 experts (W8A8, as the FP8 linear layers: kernels/linear_fp8.py): each GEMM's input is quantized per token
(kernels/fp8.py's power-of-two scales: x once per token, the SiLU-and-mul output h once per (token, expert) pair,
a pass of its own), or, where the projection has a static `input_scale` (a checkpoint's, one for all experts),
by that one scale, and the tiles multiply as e4m3 on the tensor cores (float32 accumulation, promoted every K
tile; float32 x and the interpreter multiply the same e4m3 values in float32). The scales come after the dot:
a block scale per K tile (BLOCK_K divides bk, so a tile lies in one block column), the token's and a per-row
weight scale once at the end:

    out[pair, n] = x_scale[pair] * sum over K tiles (sum_k x_q[pair, k] * w_q[n, k]) * w_scale[n, tile's block]

The reference computes the same in float32 on dequantized values: linear(a, w) = (quantized a, dequantized) @
(w_q * scale, dequantized).T, rounded to a's dtype.

`_moe_quant_gemm_kernel` is `_moe_gemm_kernel` (kernels/moe.py: one BLOCK_M tile of an expert's (token, slot) pairs
against BLOCK_N output features) with int weight tiles unpacked by kernels/int_tiles.py's `weight_tile`
(kernels/linear_int.py's: one row of zeros and scales when the tile's inputs are one group, else a gather per
element, act-order; each packed word loaded once for 64-row tiles), FP8 tiles as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import moe_int_decode
from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    is_interpreting,
    pdl_options,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.fp8 import FP8_DTYPE, QuantizedRows, dequantize_weight
from kernels.int_tiles import rounded_tile_dot
from kernels.linear_fp8 import _fp8_dot
from kernels.linear_int import IntPacking, dequantize_ref
from kernels.moe import (
    aligner,
    experts_loop_ref,
    grouped_tile,
    moe_config,
    store_pair_rows,
)


@dataclass(frozen=True)
class IntExperts:
    """One projection's experts as packed integers (see the module docstring); `group_size` None: one group over
    K."""

    qweight: torch.Tensor
    qzeros: torch.Tensor | None
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int | None
    packing: IntPacking
    mins: torch.Tensor | None = None  # GGUF's additive minimums, in place of qzeros

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of one expert's weight."""
        p = self.packing.pack_factor
        _, rows, cols = self.qweight.shape
        return (cols, rows * p) if self.packing.is_packed_along_k else (cols * p, rows)

    def dequantize(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s W [N, K] in `dtype`."""
        g_idx = None if self.g_idx is None else self.g_idx[expert]
        return dequantize_ref(self.qweight[expert], None if self.qzeros is None else self.qzeros[expert],
                              self.scales[expert], g_idx, self.group_size, self.packing, dtype,
                              None if self.mins is None else self.mins[expert])

    def check(self, name: str) -> None:
        n, k = self.shape
        p, g = self.packing.pack_factor, self.group_size or k
        check_dtype(f"{name} qweight", self.qweight, (torch.int32,))
        if (self.qzeros is None) == (self.mins is None):
            raise ValueError(f"{name}: give qzeros or mins, not both or neither")
        check_dtype(f"{name} scales", self.scales, FLOAT_DTYPES)
        num_groups = self.scales.shape[1] if self.scales.dim() == 3 else -1
        expected = {"scales": (self.num_experts, num_groups, n)}
        if self.qzeros is not None:
            check_dtype(f"{name} qzeros", self.qzeros, (torch.int32,))
            expected["qzeros"] = (self.num_experts, num_groups, n // p)
        else:
            check_dtype(f"{name} mins", self.mins, FLOAT_DTYPES)
            expected["mins"] = (self.num_experts, num_groups, n)
        if self.g_idx is None and num_groups != k // g:
            raise ValueError(f"{name}: {num_groups} groups of scales, {k} input features in groups of {g}")
        if self.g_idx is not None:
            check_dtype(f"{name} g_idx", self.g_idx, (torch.int32,))
            expected["g_idx"] = (self.num_experts, k)
        for field, shape in expected.items():
            if tuple(getattr(self, field).shape) != shape:
                raise ValueError(f"{name} {field} must be {shape} for qweight {tuple(self.qweight.shape)}, got "
                                 f"{tuple(getattr(self, field).shape)}")

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.qzeros, self.scales, self.g_idx, self.mins) if t is not None]

    def max_block_k(self) -> int | None:
        """The largest K tile that keeps a tile inside one group (no gather), None: any."""
        return self.group_size if self.g_idx is None else None

    def kernel_args(self, block_k: int) -> tuple[tuple, tuple, dict]:
        """(tensors w, z, s, g; strides; constexprs) of `_moe_quant_gemm_kernel`."""
        k = self.shape[1]
        g_idx = self.g_idx if self.g_idx is not None else self.qweight
        zeros = self.qzeros if self.qzeros is not None else self.mins  # the kernel's z_ptr holds either
        tensors = (self.qweight, zeros, self.scales, g_idx)
        strides = (self.qweight.stride(0), self.qweight.stride(1), zeros.stride(0), zeros.stride(1),
                   self.scales.stride(0), self.scales.stride(1), g_idx.stride(0))
        flags = dict(IS_FP8=False, PER_ROW=False, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1,
                     ZERO_OFFSET=self.packing.zero_offset, BITS=self.packing.bits,
                     PACKED_ALONG_K=self.packing.is_packed_along_k, AWQ_ORDER=self.packing.fields is not None,
                     HAS_G_IDX=self.g_idx is not None, HAS_MINS=self.mins is not None,
                     ONE_GROUP=self.g_idx is None and (self.group_size or k) % block_k == 0)
        return tensors, strides, flags

    def scalar_args(self) -> tuple[int, int]:
        """(group_size, up_scale_row) of the kernel: the group over all of K when there is one."""
        return self.group_size or self.shape[1], 0


@dataclass(frozen=True)
class Fp8Experts:
    """One projection's experts as e4m3 with float32 scales (see the module docstring); `parts`: 2 for gate/up."""

    weight: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    parts: int = 1
    input_scale: torch.Tensor | None = None  # float32 [1], a power of two: static activations (else per token)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[1], self.weight.shape[2]

    def quantize_input(self, a: torch.Tensor, reference: bool = False) -> QuantizedRows:
        """The GEMM's input a [T, K] as the kernel reads it: per token, or by the static input scale."""
        return QuantizedRows.of(a, reference, static_scale=self.input_scale)

    def dequantize(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        if self.block_size is None:
            return dequantize_weight(self.weight[expert], self.scale[expert]).to(dtype)
        rows, blocks = self.weight.shape[1] // self.parts, self.scale.shape[1] // self.parts
        return torch.cat([dequantize_weight(self.weight[expert, i * rows:(i + 1) * rows],
                                            self.scale[expert, i * blocks:(i + 1) * blocks], self.block_size)
                          for i in range(self.parts)]).to(dtype)

    def check(self, name: str) -> None:
        check_dtype(f"{name} weight", self.weight, (FP8_DTYPE,))
        check_dtype(f"{name} scale", self.scale, (torch.float32,))
        n, k = self.shape
        if n % self.parts:
            raise ValueError(f"{name}: {n} rows do not split into {self.parts} parts")
        if self.block_size is None:
            expected: tuple[int, ...] = (self.num_experts, n)
        else:
            bn, bk = self.block_size
            expected = (self.num_experts, self.parts * cdiv(n // self.parts, bn), cdiv(k, bk))
        if tuple(self.scale.shape) != expected:
            raise ValueError(f"{name} scale must be {expected} for weight {tuple(self.weight.shape)} and "
                             f"block_size {self.block_size}, got {tuple(self.scale.shape)}")
        if self.input_scale is not None:
            check_dtype(f"{name} input_scale", self.input_scale, (torch.float32,))
            if self.input_scale.numel() != 1:
                raise ValueError(f"{name} input_scale must hold one value, got shape "
                                 f"{tuple(self.input_scale.shape)}")

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale]

    def max_block_k(self) -> int | None:
        """Block scales: a K tile must lie in one block column (a power of two dividing bk)."""
        if self.block_size is None:
            return None
        bk = self.block_size[1]
        return bk & -bk  # the largest power of two dividing it

    def kernel_args(self, block_k: int) -> tuple[tuple, tuple, dict]:
        w, s = self.weight, self.scale
        tensors = (w, w, s, w)
        strides = (w.stride(0), w.stride(1), 0, 0, s.stride(0), s.stride(1) if s.dim() == 3 else 0, 0)
        bn, bk = self.block_size or (1, 1)
        flags = dict(IS_FP8=True, PER_ROW=self.block_size is None, SCALE_BLOCK_N=bn, SCALE_BLOCK_K=bk,
                     ZERO_OFFSET=0, BITS=8, PACKED_ALONG_K=False, AWQ_ORDER=False, HAS_G_IDX=False, HAS_MINS=False,
                     ONE_GROUP=False)
        return tensors, strides, flags

    def scalar_args(self) -> tuple[int, int]:
        return 1, (self.scale.shape[1] // self.parts if self.block_size is not None else 0)


QuantizedExperts = IntExperts | Fp8Experts
MAX_BLOCK_K = 64


@triton.jit
def _fp8_block_dot(xv, w_ptr, s_ptr, ks, k_mask, rows, scale_rows, n_mask, k0, stride_w, stride_s,
                   PER_ROW: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, PRECISE: tl.constexpr,
                   PROMOTE_K: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: e4m3 x tile @ W.T at input features ks, weight rows `rows` (the e4m3 values as
    stored), times the tile's block scales (scale_rows: block rows; the tile lies in block column k0 // bk);
    per-row scales come later, once."""
    w = tl.load(w_ptr + rows[None, :] * stride_w + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    part = _fp8_dot(xv, w, PRECISE, PROMOTE_K)
    if not PER_ROW:
        part = part * tl.load(s_ptr + scale_rows * stride_s + k0 // SCALE_BLOCK_K, mask=n_mask, other=0.0)[None, :]
    return part


# num_pairs changes with every step's batch: not specialized on (kernels/moe.py says why)
@triton.jit(do_not_specialize=["num_pairs", "num_tiles"])
def _moe_quant_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, z_ptr, s_ptr, g_ptr, out_ptr, routing_ptr, sorted_ids_ptr, tile_experts_ptr,
    num_padded_ptr, N, K, num_pairs, num_tiles, group_size, up_row, up_scale_row,
    stride_a, stride_o, stride_we, stride_w, stride_ze, stride_z, stride_se, stride_s, stride_ge,
    IS_FP8: tl.constexpr, PER_ROW: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr,
    HAS_G_IDX: tl.constexpr, HAS_MINS: tl.constexpr, ONE_GROUP: tl.constexpr, UNPACK_ONCE: tl.constexpr,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, PRECISE: tl.constexpr, PROMOTE_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """out[pair, n-block] for one tile of pairs, as kernels/moe.py's `_moe_gemm_kernel` (its `grouped_tile`
    order); GATED: the up rows are weight rows up_row + n (their FP8 block scales from block row up_scale_row).
    IS_FP8: a is e4m3 with a scale per row (a_scale_ptr), multiplied on the FP8 tensor cores (the module doc)."""
    wait_for_prior(PDL)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    tile, n_block = grouped_tile(num_tiles, num_n_blocks, GROUP_M)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    n0 = n_block * BLOCK_N
    offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    w_e, z_e = w_ptr + expert * stride_we, z_ptr + expert * stride_ze
    s_e, g_e = s_ptr + expert * stride_se, g_ptr + expert * stride_ge
    if PER_ROW:
        scale_rows, up_scale_rows = offs_n, up_row + offs_n
    else:  # block rows (FP8 blocks; unused by int tiles)
        scale_rows, up_scale_rows = offs_n // SCALE_BLOCK_N, up_scale_row + offs_n // SCALE_BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_mask = ks < K
        xv = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                     other=0.0)
        if IS_FP8:
            acc += _fp8_block_dot(xv, w_e, s_e, ks, k_mask, offs_n, scale_rows, n_mask, k0, stride_w, stride_s,
                                  PER_ROW, SCALE_BLOCK_K, PRECISE, PROMOTE_K)
            if GATED:
                acc_up += _fp8_block_dot(xv, w_e, s_e, ks, k_mask, up_row + offs_n, up_scale_rows, n_mask, k0,
                                         stride_w, stride_s, PER_ROW, SCALE_BLOCK_K, PRECISE, PROMOTE_K)
        else:  # W rounded to x's dtype, as the reference rounds it
            acc += rounded_tile_dot(xv, w_e, z_e, s_e, g_e, k0, ks, k_mask, n0, offs_n, n_mask, N, K, stride_w,
                                    stride_z, stride_s, group_size, ZERO_OFFSET, BITS, PACKED_ALONG_K, AWQ_ORDER,
                                    HAS_G_IDX, ONE_GROUP, HAS_MINS, UNPACK_ONCE, UPCAST, PRECISION, BLOCK_K, BLOCK_N)
            if GATED:
                acc_up += rounded_tile_dot(xv, w_e, z_e, s_e, g_e, k0, ks, k_mask, up_row + n0, up_row + offs_n,
                                           n_mask, up_row + N, K, stride_w, stride_z, stride_s, group_size,
                                           ZERO_OFFSET, BITS, PACKED_ALONG_K, AWQ_ORDER, HAS_G_IDX, ONE_GROUP,
                                           HAS_MINS, UNPACK_ONCE, UPCAST, PRECISION, BLOCK_K, BLOCK_N)
    if IS_FP8:  # the token's scale, and the weight row's
        x_scale = tl.load(a_scale_ptr + a_rows, mask=row_mask, other=0.0)[:, None]
        acc = acc * x_scale
        acc_up = acc_up * x_scale
        if PER_ROW:
            acc = acc * tl.load(s_e + scale_rows, mask=n_mask, other=0.0)[None, :]
            if GATED:
                acc_up = acc_up * tl.load(s_e + up_scale_rows, mask=n_mask, other=0.0)[None, :]
    store_pair_rows(acc, acc_up, out_ptr, routing_ptr, pairs, row_mask, offs_n, n_mask, stride_o, GATED, WEIGHTED)


def _check_inputs(x, w13: QuantizedExperts, w2: QuantizedExperts, topk_weights, topk_ids) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    w13.check("w13")
    w2.check("w2")
    (two_inter, hidden), (w2_out, inter) = w13.shape, w2.shape
    if hidden != x.shape[1] or two_inter != 2 * inter or w2_out != hidden or w13.num_experts != w2.num_experts:
        raise ValueError(f"experts w13 {w13.num_experts} x {w13.shape} and w2 {w2.num_experts} x {w2.shape} do not "
                         f"fit x {tuple(x.shape)}: expected [2I, H] and [H, I] per expert")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [T={x.shape[0]}, top_k], got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)}")
    check_dtype("topk_ids", topk_ids, (torch.int64, torch.int32))
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    if isinstance(w13, Fp8Experts) != isinstance(w2, Fp8Experts):
        raise ValueError("w13 and w2 must both be FP8 experts or both integer ones")


def _config(num_pairs: int, experts: QuantizedExperts, out_features: int, gated: bool, x, overrides) -> dict:
    """kernels/moe.py's `moe_config`, K tiles kept inside one group / scale block (shared memory: the packed tiles
    are smaller than the float ones it budgets)."""
    cfg = moe_config(num_pairs, experts.num_experts, out_features, gated, x.dtype, x.device)
    # two [BLOCK_K, BLOCK_N] float32 tiles dequantized at once (gate, up): 128 x 64 ones spilled on sm_90 (and tiles
    # at most 64 wide: the bf16 kernel's 128-wide 64-row tiles are not timed with dequantization); FP8 tiles keep
    # the same caps until timed otherwise
    cfg = {**cfg, "BLOCK_K": min(cfg["BLOCK_K"], MAX_BLOCK_K), "BLOCK_N": min(cfg["BLOCK_N"], 64), **(overrides or {})}
    # tile settings (tuning, tests) are this GEMM's: a call that gives them runs it, not kernels/moe_int_decode.py
    cfg.setdefault("NO_STREAM", bool(overrides))
    # each packed word loaded once for the 64-row tiles of larger batches (kernels/linear_int.py's choice: its
    # GEMM tiles do, its decode tiles not); needs tiles of whole words, which the shapes checked at load give
    is_int = isinstance(experts, IntExperts)
    cfg.setdefault("UNPACK_ONCE", is_int and cfg["BLOCK_M"] >= 64)
    limit = experts.max_block_k()
    if limit is not None and not (overrides or {}).get("BLOCK_K"):
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], limit)
    if isinstance(experts, Fp8Experts) and limit is not None and limit % cfg["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} must divide the FP8 scale block's {experts.block_size[1]} "
                         "columns (a K tile reads one block's scale)")
    p = experts.packing.pack_factor if isinstance(experts, IntExperts) else 1
    if cfg["UNPACK_ONCE"] and (cfg["BLOCK_N"] % p or cfg["BLOCK_K"] % p or out_features % p):
        raise ValueError(f"UNPACK_ONCE needs tiles of whole int32s of {p} values")
    if cfg["BLOCK_K"] < 16:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} is below tl.dot's 16: a group or scale block of fewer "
                         "columns is not supported")
    return cfg


def _grouped_gemm(a, experts: QuantizedExperts, out, aligned, rows_per_a: int, gated: bool, cfg: dict,
                  routing=None) -> None:
    """One launch: out[pair] = a[pair // rows_per_a] @ W[expert of the pair's tile].T (gated: silu-and-mul;
    routing: times routing[pair]); a: x's dtype, or QuantizedRows for FP8 experts."""
    values, scales = (a.values, a.scale) if isinstance(a, QuantizedRows) else (a, a)
    if isinstance(experts, IntExperts) and not cfg.get("NO_STREAM") and moe_int_decode.takes(experts, cfg["BLOCK_M"],
                                                                                             gated):
        moe_int_decode.moe_int_stream(values, experts, out, aligned, rows_per_a, gated, routing,
                                      upcast_dot_operands(values.dtype, values.device), dot_precision(values.dtype))
        return
    sorted_ids, tile_experts, num_padded = aligned
    n_total, k = experts.shape
    n = n_total // 2 if gated else n_total
    tensors, strides, flags = experts.kernel_args(cfg["BLOCK_K"])
    group_size, up_scale_row = experts.scalar_args()
    num_tiles = tile_experts.shape[0]
    _moe_quant_gemm_kernel[(num_tiles * cdiv(n, cfg["BLOCK_N"]),)](
        values, scales, *tensors, out, out if routing is None else routing, sorted_ids, tile_experts, num_padded,
        n, k, out.shape[0], num_tiles, group_size, n, up_scale_row, values.stride(0), out.stride(0),
        *strides, **flags,
        UNPACK_ONCE=cfg["UNPACK_ONCE"], ROWS_PER_A=rows_per_a, GATED=gated, WEIGHTED=routing is not None,
        UPCAST=upcast_dot_operands(values.dtype, values.device), PRECISION=dot_precision(values.dtype),
        PRECISE=is_interpreting() or out.dtype == torch.float32, PROMOTE_K=cfg["BLOCK_K"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], **pdl_options(values.device), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def fused_moe_quant_triton(x, w13: QuantizedExperts, w2: QuantizedExperts, topk_weights, topk_ids,
                           config: dict | None = None):
    """Triton launcher of `fused_moe_quant`: kernels/moe.py's alignment, two grouped-GEMM launches over the
    quantized experts (FP8 ones: each input quantized per token first), the slots' sum. config overrides the launch
    settings of both GEMMs (tuning)."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    check_launchable(x, topk_weights, topk_ids, *w13.tensors(), *w2.tensors())
    check_last_dim_contiguous("x", x)
    for name, experts in (("w13", w13), ("w2", w2)):
        for t in experts.tensors():
            check_last_dim_contiguous(name, t)
    num_tokens, top_k = topk_ids.shape
    num_pairs, inter, hidden = num_tokens * top_k, w2.shape[1], x.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg_up = _config(num_pairs, w13, inter, True, x, config)
    cfg_down = _config(num_pairs, w2, hidden, False, x, config)
    if cfg_down["BLOCK_M"] != cfg_up["BLOCK_M"]:
        raise ValueError("both GEMMs must use one BLOCK_M: they share the expert alignment")
    fp8 = isinstance(w13, Fp8Experts)
    align = aligner(num_pairs, w13.num_experts)
    aligned = align(topk_ids, w13.num_experts, cfg_up["BLOCK_M"])
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(w13.quantize_input(x) if fp8 else x, w13, h, aligned, top_k, True, cfg_up)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(w2.quantize_input(h) if fp8 else h, w2, out, aligned, 1, False, cfg_down,
                  routing=topk_weights.reshape(-1).contiguous())
    return out.view(num_tokens, top_k, hidden).sum(dim=1) if top_k > 1 else out


def _fp8_linear_ref(experts: Fp8Experts):
    """linear(a, w): a quantized as `experts` quantize their input (per token by the torch reference, or by the
    static scale), dequantized, @ float32 w.T, rounded to a's dtype."""
    return lambda a, w: F.linear(experts.quantize_input(a, reference=True).dequantize(), w).to(a.dtype)


def fused_moe_quant_ref(x, w13: QuantizedExperts, w2: QuantizedExperts, topk_weights, topk_ids):
    """Torch reference of `fused_moe_quant` (and its CPU implementation): `kernels.moe.fused_moe_ref` with each
    chosen expert's weights dequantized for this call: to x's dtype (int experts), or to float32 with the FP8
    experts' inputs quantized per token (the module doc)."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    if isinstance(w13, Fp8Experts):
        return experts_loop_ref(x, lambda e: (w13.dequantize(e, torch.float32), w2.dequantize(e, torch.float32)),
                                w13.num_experts, topk_weights, topk_ids,
                                linears=(_fp8_linear_ref(w13), _fp8_linear_ref(w2)))
    return experts_loop_ref(x, lambda e: (w13.dequantize(e, x.dtype), w2.dequantize(e, x.dtype)), w13.num_experts,
                            topk_weights, topk_ids)


def fused_moe_quant(x, w13: QuantizedExperts, w2: QuantizedExperts, topk_weights, topk_ids):
    """x [T, H]; quantized experts w13 ([gate ; up] rows, [2I, H] each) and w2 ([H, I] each); topk_weights and
    topk_ids [T, K] -> [T, H] in x's dtype (kernels.moe.fused_moe's result over the dequantized weights; FP8
    experts: over each GEMM's input quantized per token too)."""
    if use_triton(x):
        return fused_moe_quant_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_quant_ref(x, w13, w2, topk_weights, topk_ids)
