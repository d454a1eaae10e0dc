"""FP8 (float8_e4m3fn) quantization: the definitions every FP8 kernel and reference shares.

    weights       w ~ w_q * w_scale[n]        per output channel (or per block), any float32 scale, set at load
    activations   x ~ x_q * x_scale[t]        per token, dynamic: x_scale = pow2_scale(amax |x[t]|, 8)
    KV cache      k ~ k_q * k_scale[h]        per KV head, fixed at load: pow2_scale(amax, 6) (2 bits headroom)

Activation and KV scales are powers of two, so `x * (1 / scale)` is exact and the rounding to e4m3 (to nearest,
ties to even, after clamping to +-448) is the only rounding: a Triton kernel and its torch reference quantize bit
for bit alike. e4m3 is a floating-point format, so a power-of-two scale costs no precision, only at most one bit
of range at the top (the largest value lands in [224, 448]).

    pow2_scale(amax, e):  the least 2^k with 1.75 * 2^e * 2^k >= amax   (1.75 * 2^8 = 448)

Triton's interpreter converts float32 to float8 by truncating (and mishandles a rounding carry), so under the
interpreter `to_e4m3` rounds in float32 arithmetic first and the cast is then exact; on a GPU it is the hardware's
round-to-nearest-even conversion, the same result.

`QuantizedRows` carries activations quantized where they were computed (RMSNorm's fused quantization,
kernels/rms_norm.py) to the FP8 linear that reads them (kernels/linear_fp8.py), with no bf16 copy between.
"""

from dataclasses import dataclass

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

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
ACTIVATION_EXP = 8  # activations: the row's largest value maps into [224, 448]
KV_EXP = 6  # KV cache: the calibrated largest value maps into [56, 112], room for 4x larger values later
EMPTY_ROW_SCALE = 2.0 ** -126  # pow2_scale(0): the scale of a row with no elements


@dataclass
class QuantizedRows:
    """x [T, K] ~ values * scale[:, None]: per-token quantized activations (the definitions above)."""

    values: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T] float32, powers of two
    dtype: torch.dtype  # x's own dtype: the consuming linear's output dtype

    @classmethod
    def of(cls, x: torch.Tensor, reference: bool = False, static_scale: torch.Tensor | None = None
           ) -> "QuantizedRows":
        """x quantized per token: `quantize_per_token` (or its torch reference); with `static_scale` (float32 [1],
        a power of two: a checkpoint's static input scale), every row by that one scale, values beyond it clamped
        to +-448."""
        if static_scale is not None:
            scale = static_scale.float()
            return cls(quantize_ref(x, 1.0 / scale), scale.expand(x.shape[0]).contiguous(), x.dtype)
        values, scale = (quantize_per_token_ref if reference else quantize_per_token)(x)
        return cls(values, scale, x.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        """float32 values * scale."""
        return dequantize(self.values, self.scale[:, None])


# ---- torch ---------------------------------------------------------------------------------------------------------
def pow2_scale(amax: torch.Tensor, target_exp: int) -> torch.Tensor:
    """The least power of two 2^k (k in [-126, 126]) with 1.75 * 2^target_exp * 2^k >= amax, from amax's bits."""
    bits = amax.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    k = exponent - target_exp + ((bits & 0x7FFFFF) > 0x600000).int()  # 1.mantissa > 1.75: one more
    return ((k.clamp(-126, 126) + 127) << 23).view(torch.float32)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The least power of two >= x > 0 (a checkpoint's static input scale, rounded up)."""
    bits = x.float().contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) > 0).int()
    return ((k.clamp(-126, 126) + 127) << 23).view(torch.float32)


def quantize_ref(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x * inv_scale (broadcast) rounded to e4m3, clamped to +-448."""
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_q [T, K] e4m3, scale [T] float32): each row's power-of-two scale from its largest |x|."""
    amax = x.float().abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1], dtype=torch.float32)
    scale = pow2_scale(amax, ACTIVATION_EXP)
    return quantize_ref(x, (1.0 / scale)[..., None]), scale


def dequantize(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x_q * scale (scale broadcast against x_q)."""
    return x_q.float() * scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_q [N, K] e4m3, scale [N] float32 = amax of the row / 448); all-zero rows get scale 1."""
    amax = w.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return quantize_ref(w, (1.0 / scale)[:, None]), scale


def quantize_weight_blocks(w: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_q, scale [ceil(N/bn), ceil(K/bk)]): a scale per block, its largest |w| / 448 (or 1)."""
    rows, cols = block_size
    n, k = w.shape
    padded = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float().abs()
    amax = padded.unflatten(0, (-1, rows)).unflatten(2, (-1, cols)).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]
    return quantize_ref(w, 1.0 / full), scale


def dequantize_weight(w_q: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None = None):
    """float32 weights from e4m3 ones and their scales: [N] per row, or [ceil(N/bn), ceil(K/bk)] per block."""
    if block_size is None:
        return dequantize(w_q, scale[:, None])
    rows, cols = block_size
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:w_q.shape[0], :w_q.shape[1]]
    return dequantize(w_q, full)


# ---- Triton --------------------------------------------------------------------------------------------------------
@triton.jit
def to_e4m3(x, EXACT: tl.constexpr):
    """float32 -> float8e4nv, clamped to +-448, rounded to nearest even. EXACT (the interpreter): round in
    float32 first (adding and subtracting 1.5 * 2^(e + 20) leaves x a multiple of e4m3's step 2^(e - 3) at
    exponent e, e >= -6 for the subnormals), so that the cast only has to drop zero bits."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EXACT:
        biased = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        magic = (((tl.maximum(biased, -6) + 20 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
        ax = tl.abs(x)
        rounded = (ax + magic) - magic
        x = tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit: -0.0 stays -0.0
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def pow2_scales(amax, TARGET_EXP: tl.constexpr):
    """(scale, 1 / scale): `pow2_scale` of float32 amax >= 0, both exact powers of two."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - TARGET_EXP + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.minimum(tl.maximum(k, -126), 126)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_per_token_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, stride_o, BLOCK_K: tl.constexpr,
                               EXACT: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale, inv = pow2_scales(tl.max(amax, 0), 8)  # ACTIVATION_EXP
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(x * inv, EXACT), mask=cols < K)
    tl.store(scale_ptr + row, scale)


# A row of up to this many values is read in one load a pass. At decode sizes the kernel is one program a row, so
# each pass's loads are its latency: a Llama-3-8B down projection's input (14,336) took 3.6 us in 4096-wide loads
# on the H200 against 1.3 us for a 4096-long row (benchmarks/results/h200-fp8-swap-quantize-in-kernel.json).
MAX_QUANTIZE_BLOCK = 16384


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `quantize_per_token`: one program per row, two passes over it (amax, then quantize)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_launchable(x)
    check_last_dim_contiguous("x", x)
    num_rows, k = x.shape
    out = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows and k:
        block_k = min(next_power_of_2(k), MAX_QUANTIZE_BLOCK)
        _quantize_per_token_kernel[(num_rows,)](x, out, scale, k, x.stride(0), out.stride(0), BLOCK_K=block_k,
                                                EXACT=is_interpreting(), **pdl_options(x.device),
                                                num_warps=16 if block_k >= 8192 else 8 if block_k >= 2048 else 4)
    elif num_rows:
        scale.fill_(EMPTY_ROW_SCALE)
    return out, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_q e4m3 [T, K], scale float32 [T]) with x ~ x_q * scale[:, None] (see the module doc)."""
    if use_triton(x):
        return quantize_per_token_triton(x)
    return quantize_per_token_ref(x)
