"""RMSNorm, optionally fused with the residual add that precedes it in a Llama decoder layer.

Hugging Face's LlamaRMSNorm, reproduced rounding step by rounding step:

    hidden = residual + hidden                          # input dtype (the fused add)
    normed = (hidden.float() * rsqrt(mean(hidden.float() ** 2) + eps)).to(hidden.dtype)
    out    = weight * normed                            # rounded to the input dtype

The output has x's dtype; with weight in x's dtype (how models load) this is HF's result exactly.

quantize=True (the input of an FP8 linear, kernels/linear_fp8.py): that output, still rounded to x's dtype, is
quantized per token in the same kernel (kernels/fp8.py's definitions: the same e4m3 values and scales as
`quantize_per_token` of the unfused output) and returned as `QuantizedRows`; it never goes to memory in x's dtype.
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
from kernels.fp8 import FP8_DTYPE, QuantizedRows, pow2_scales, to_e4m3


@triton.jit
def normed_rounded(xf, inv_rms, w, dtype: tl.constexpr):
    """RMSNorm's output from float32 x, its 1 / rms and float32 weights, rounded as HF rounds it: x * inv_rms to
    dtype, then times the weight, to dtype (shared with kernels/rotary.py's per-head norms)."""
    return ((xf * inv_rms).to(dtype).to(tl.float32) * w).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_nr, hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds to the input dtype, as in HF
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden_size + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = normed_rounded(xf, inv_rms, w, x.dtype)
    if QUANTIZE:  # quantize_per_token of that output (ACTIVATION_EXP = 8)
        out = out.to(tl.float32)
        scale, inv = pow2_scales(tl.max(tl.abs(out), 0), 8)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(out * inv, EXACT), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def _check_inputs(x, weight, residual) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [hidden={x.shape[1]}], got {tuple(weight.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")


def rms_norm_triton(x, weight, eps, residual=None, quantize=False):
    """Triton launcher of `rms_norm`: one program per row (rows may be strided)."""
    _check_inputs(x, weight, residual)
    tensors = (x, weight) if residual is None else (x, weight, residual)
    check_launchable(*tensors)
    for name, t in zip(("x", "weight", "residual"), tensors):
        check_last_dim_contiguous(name, t)
    num_tokens, hidden_size = x.shape
    out = torch.empty(x.shape, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device) if quantize else None
    new_residual = torch.empty_like(x) if residual is not None else x
    if num_tokens > 0:
        block = next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, new_residual,
            scale if quantize else weight,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), new_residual.stride(0),
            hidden_size, eps,
            HAS_RESIDUAL=residual is not None, QUANTIZE=quantize, EXACT=is_interpreting(), BLOCK=block,
            **pdl_options(x.device), num_warps=min(max(block // 512, 1), 16),
        )
    if quantize:
        out = QuantizedRows(out, scale, x.dtype)
    return out if residual is None else (out, new_residual)


def rms_norm_ref(x, weight, eps, residual=None, quantize=False):
    """Torch reference of `rms_norm` (and its CPU implementation): Hugging Face's LlamaRMSNorm."""
    _check_inputs(x, weight, residual)
    if residual is not None:
        x = residual + x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight * normed).to(x.dtype)
    if quantize:
        out = QuantizedRows.of(out, reference=True)
    return out if residual is None else (out, x)


def rms_norm(x, weight, eps, residual=None, quantize=False):
    """RMSNorm of x [T, H] with weight [H]: x * rsqrt(mean(x^2) + eps) * weight, in float32, out in x's dtype
    (quantize: as `QuantizedRows`, see the module doc).

    With residual [T, H]: returns (rms_norm(x + residual), x + residual), the sum rounded to x's dtype, which
    is HF Llama's `hidden = residual + hidden; hidden = norm(hidden)`. Inputs are never modified.
    """
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, quantize)
    return rms_norm_ref(x, weight, eps, residual, quantize)
