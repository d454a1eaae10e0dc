"""Weight-only integer linear layers (W4A16, W8A16): AWQ and GPTQ weights as their checkpoints store them,
dequantized on the fly.

    AWQ (AutoAWQ, version "gemm")                   GPTQ v1 (AutoGPTQ, GPTQModel)
    qweight int32 [K, N / 8]: 8 columns an int32    qweight int32 [K / p, N]: p = 32 / bits rows an int32,
            column j of each 8 in nibble                    row j of each p in field j (bits * j)
            AWQ_FIELDS[j] (AutoAWQ packs in the
            order 0 2 4 6 1 3 5 7)
    qzeros  int32 [G, N / 8]: as qweight's columns  qzeros  int32 [G, N / p]: columns in fields 0.., each
                                                            stored as zero - 1 (v1's off-by-one)
    scales  fp16  [G, N]                            scales  fp16  [G, N]
    group of input feature k: k // group_size       g_idx   int32 [K]: input feature k's group (act-order)

    W[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]        y = x @ W.T

`dequantize_ref` writes W [N, K] in the activations' dtype (computed in float32: (q - zero) * scale is exact there
for fp16 scales), and `linear_int_ref` hands it to `kernels.linear.linear`, so an int layer computes what an
unquantized layer holding the dequantized weight computes, bit for bit. The weight is dequantized per call and
dropped: the layer holds only the packed tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.linear import linear

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


def dequantize_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                   group_size: int | None, packing: IntPacking, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` (see the module docstring); g_idx None: k // group_size."""
    q = unpack_weight(qweight, packing)  # [K, N]
    zeros = unpack_zeros(qzeros, packing)  # [G, N]
    assert zeros.shape == scales.shape, f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} differ"
    groups = (g_idx if g_idx is not None else group_index(q.shape[0], group_size, q.device)).long()  # [K]
    w = (q - zeros[groups]).float() * scales[groups].float()  # [K, N], exact in float32
    return w.t().contiguous().to(dtype)


def linear_int_ref(x: torch.Tensor, qweight, qzeros, scales, g_idx, group_size: int | None, packing: IntPacking,
                   bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) -> [T, N] (gated: silu(gate) * up, [T, N / 2]), W dequantized for this call."""
    weight = dequantize_ref(qweight, qzeros, scales, g_idx, group_size, packing, x.dtype)
    return linear(x, weight, bias, gated)
