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
    or, with `mins` [G, N] in place of qzeros (GGUF Q4_1):  W[n, k] = q[k, n] * scale[g(k), n] + min[g(k), n]

`dequantize_ref` writes W [N, K] in the activations' dtype (computed in float32: (q - zero) * scale is exact there
for fp16 scales), and `linear_int_ref` hands it to `kernels.linear.linear`, so an int layer computes what an
unquantized layer holding the dequantized weight computes, bit for bit. The weight is dequantized per call and
dropped: the layer holds only the packed tensors.

For up to MAX_ROWS rows on a GPU (decode), `_int_linear_kernel` never writes W: each program owns BLOCK_N output
features, walks K, and unpacks and dequantizes each [BLOCK_K, BLOCK_N] tile of integers in registers (the same
float32 arithmetic, rounded to x's dtype) before its tl.dot; the gated SiLU-and-mul epilogue is kernels/linear.py's.
A first version: a tile inside one group (no g_idx, BLOCK_K dividing group_size) reads one row of zeros and scales;
otherwise (act-order) it gathers them per element (cached reads, not streamed ones). Its speed is not yet measured
on a GPU; larger batches take the reference (dequantize, then cuBLAS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    next_power_of_2,
    pdl_options,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.linear import MAX_ROWS, linear, store_output

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
    and GGUF Q4_0 / Q8_0 repacked at load), zero points as stored: GPTQ's layout without its off-by-one."""
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


def group_index(num_in_features: int, group_size: int | None, device) -> torch.Tensor:
    """Each input feature's group when there is no g_idx: k // group_size (None: one group)."""
    k = torch.arange(num_in_features, dtype=torch.int32, device=device)
    return k // group_size if group_size is not None else torch.zeros_like(k)


def dequantize_ref(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, group_size: int | None, packing: IntPacking, dtype: torch.dtype,
                   mins: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in `dtype` (see the module docstring); g_idx None: k // group_size. `mins` [G, N] (GGUF Q4_1)
    instead of zero points: W = q * scale + min, rounded once in float32 as gguf's dequantization rounds it."""
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
               bias: torch.Tensor | None = None, gated: bool = False, mins=None) -> torch.Tensor:
    """`linear_int_ref`'s result: the Triton kernel for x of at most MAX_ROWS rows on a GPU, else the reference."""
    if use_triton(x) and x.shape[0] <= MAX_ROWS:
        return linear_int_triton(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins=mins)
    return linear_int_ref(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins)


@triton.jit
def _field_shift(j, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """The shift of value j (of the 32 / BITS an int32 packs): AWQ's nibble (j % 2) * 4 + j // 2 (its order
    0 2 4 6 1 3 5 7 inverted), else field j."""
    if AWQ_ORDER:
        return ((j % 2) * 4 + j // 2) * BITS
    return j * BITS


@triton.jit
def _dequantized_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, k_mask, cols, n_mask, stride_qw, stride_qz, stride_s,
                      group_size, ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr,
                      AWQ_ORDER: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP: tl.constexpr,
                      HAS_MINS: tl.constexpr):
    """float32 [BLOCK_K, BLOCK_N]: W.T at input features ks, output features cols: (q - zero) * scale, or with
    HAS_MINS q * scale + min (qz_ptr then holds the mins, float [G, N], not packed zeros).
    ONE_GROUP: the tile's inputs are one group (no g_idx, BLOCK_K divides group_size), whose zeros and scales
    are one row of BLOCK_N, not a gather per element."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    mask = k_mask[:, None] & n_mask[None, :]
    if PACKED_ALONG_K:  # GPTQ: qweight [K / P, N]
        packed = tl.load(qw_ptr + (ks // P)[:, None] * stride_qw + cols[None, :], mask=mask, other=0)
        q = (packed >> ((ks % P) * BITS)[:, None]) & MASK
    else:  # AWQ: qweight [K, N / P]
        packed = tl.load(qw_ptr + ks[:, None] * stride_qw + (cols // P)[None, :], mask=mask, other=0)
        q = (packed >> _field_shift(cols % P, BITS, AWQ_ORDER)[None, :]) & MASK
    if ONE_GROUP:  # one row of zeros (or mins) and scales: [BLOCK_N], broadcast over the tile's rows
        group = tl.min(ks, axis=0) // group_size
        scale = tl.load(s_ptr + group * stride_s + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_MINS:
            low = tl.load(qz_ptr + group * stride_qz + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            zp = tl.load(qz_ptr + group * stride_qz + cols // P, mask=n_mask, other=0)
            zeros = (((zp >> _field_shift(cols % P, BITS, AWQ_ORDER)) & MASK) + ZERO_OFFSET)[None, :]
    else:  # gathered per element: [BLOCK_K, BLOCK_N]
        if HAS_G_IDX:
            groups = tl.load(g_ptr + ks, mask=k_mask, other=0).to(tl.int64)
        else:
            groups = ks // group_size
        scale = tl.load(s_ptr + groups[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_MINS:
            low = tl.load(qz_ptr + groups[:, None] * stride_qz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            zp = tl.load(qz_ptr + groups[:, None] * stride_qz + (cols // P)[None, :], mask=mask, other=0)
            zeros = ((zp >> _field_shift(cols % P, BITS, AWQ_ORDER)[None, :]) & MASK) + ZERO_OFFSET
    if HAS_MINS:  # if / else, not an early return: the compiler would still visit what follows it
        w = q.to(tl.float32) * scale + low
    else:
        w = (q - zeros).to(tl.float32) * scale
    return w


@triton.jit
def _int_linear_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, M, N, K, group_size,
    stride_x, stride_qw, stride_qz, stride_s, stride_o, up_col,
    ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr,
    HAS_G_IDX: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_mask = ks < K
        xv = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                     other=0.0)
        w = _dequantized_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, k_mask, offs_n, n_mask, stride_qw, stride_qz,
                              stride_s, group_size, ZERO_OFFSET, BITS, PACKED_ALONG_K, AWQ_ORDER, HAS_G_IDX,
                              ONE_GROUP, HAS_MINS)
        w = w.to(x_ptr.dtype.element_ty)  # W rounded to x's dtype, as the reference rounds it
        if UPCAST:
            xv = xv.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(xv, w, input_precision=PRECISION)
        if GATED:
            w_up = _dequantized_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, k_mask, up_col + offs_n, n_mask, stride_qw,
                                     stride_qz, stride_s, group_size, ZERO_OFFSET, BITS, PACKED_ALONG_K, AWQ_ORDER,
                                     HAS_G_IDX, ONE_GROUP, HAS_MINS)
            w_up = w_up.to(x_ptr.dtype.element_ty)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(xv, w_up, input_precision=PRECISION)
    store_output(acc, acc_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_col, HAS_BIAS, GATED)


def _check_int_inputs(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated,
                      mins=None) -> tuple[int, int]:
    """(K, N) of the packed weight, after checking every shape and dtype against x's."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    if (qzeros is None) == (mins is None):
        raise ValueError("give qzeros or mins, not both or neither")
    ints = (("qweight", qweight),) + ((("qzeros", qzeros),) if qzeros is not None else ())
    for name, t in ints + ((("g_idx", g_idx),) if g_idx is not None else ()):
        check_dtype(name, t, (torch.int32,))
    check_dtype("scales", scales, FLOAT_DTYPES)
    p = packing.pack_factor
    k, n = (qweight.shape[0] * p, qweight.shape[1]) if packing.is_packed_along_k else (qweight.shape[0],
                                                                                        qweight.shape[1] * p)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} input features, the packed weight {k}")
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
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if gated and n % 2:
        raise ValueError(f"a gated weight stacks gate and up columns: an even count, got {n}")
    return k, n


def linear_int_triton(x, qweight, qzeros, scales, g_idx, group_size: int | None, packing: IntPacking,
                      bias=None, gated: bool = False, config: dict | None = None, mins=None) -> torch.Tensor:
    """Triton launcher of `linear_int` (any number of rows; meant for a few); `mins` in place of qzeros."""
    k, n = _check_int_inputs(x, qweight, qzeros, scales, g_idx, group_size, packing, bias, gated, mins)
    zero_term = mins if mins is not None else qzeros  # the kernel reads one or the other through qz_ptr
    check_launchable(*[t for t in (x, qweight, zero_term, scales, g_idx, bias) if t is not None])
    for name, t in (("x", x), ("qweight", qweight), ("qzeros" if mins is None else "mins", zero_term),
                    ("scales", scales)):
        check_last_dim_contiguous(name, t)
    num_rows, out_features = x.shape[0], n // 2 if gated else n
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2, **(config or {})}
    _int_linear_kernel[(cdiv(out_features, cfg["BLOCK_N"]),)](
        x, qweight, zero_term, scales, g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales, out, num_rows, out_features, k, group_size or k,
        x.stride(0), qweight.stride(0), zero_term.stride(0), scales.stride(0), out.stride(0), out_features,
        ZERO_OFFSET=packing.zero_offset, BITS=packing.bits, PACKED_ALONG_K=packing.is_packed_along_k,
        AWQ_ORDER=packing.fields is not None, HAS_G_IDX=g_idx is not None,
        ONE_GROUP=g_idx is None and (group_size or k) % cfg["BLOCK_K"] == 0, HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None, GATED=gated,
        UPCAST=upcast_dot_operands(x.dtype, x.device), PRECISION=dot_precision(x.dtype),
        BLOCK_M=max(16, next_power_of_2(num_rows)), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        **pdl_options(x.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
