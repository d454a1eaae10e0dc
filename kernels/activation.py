"""SiLU-and-mul: the gated activation of a Llama MLP, on the fused gate_up projection output.

    x = [gate | up]  [T, 2 * I]   ->   silu(gate) * up  [T, I]

Rounded as Hugging Face computes `act_fn(gate_proj(x)) * up_proj(x)` in the model dtype: silu in float32,
rounded to the dtype, then the product rounded again.

quantize=True (the input of an FP8 down projection): that output, still rounded to x's dtype, quantized per token
in the same kernel, as `QuantizedRows` (kernels/fp8.py: bit for bit `quantize_per_token` of the unfused output).
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
from kernels.fp8 import EMPTY_ROW_SCALE, FP8_DTYPE, QuantizedRows, pow2_scales, to_e4m3

BLOCK = 1024


@triton.jit
def _silu_mul(x_ptr, row, stride_x, inter_size, cols, mask):
    """silu(gate) * up at these columns of a row, rounded to x's dtype as HF rounds it, in float32."""
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter_size, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    value = _silu_mul(x_ptr, row, stride_x, inter_size, cols, mask)
    tl.store(out_ptr + row * stride_o + cols, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, inter_size, BLOCK: tl.constexpr,
                               EXACT: tl.constexpr, PDL: tl.constexpr):
    """One program per row: its largest |silu(gate) * up| first, then the values quantized with that row's scale
    (computed twice rather than held: any intermediate size)."""
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, inter_size, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_mul(x_ptr, row, stride_x, inter_size, cols, cols < inter_size)))
    scale, inv = pow2_scales(tl.max(amax, 0), 8)  # ACTIVATION_EXP
    for c0 in range(0, inter_size, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < inter_size
        value = _silu_mul(x_ptr, row, stride_x, inter_size, cols, mask)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(value * inv, EXACT), mask=mask)
    tl.store(scale_ptr + row, scale)


def _check_inputs(x) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [tokens, 2 * intermediate], got shape {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)


def silu_and_mul_triton(x, quantize=False):
    """Triton launcher of `silu_and_mul` (rows of x may be strided)."""
    _check_inputs(x)
    check_launchable(x)
    check_last_dim_contiguous("x", x)
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter_size, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    if not quantize:
        if num_tokens > 0 and inter_size > 0:
            grid = (num_tokens, -(-inter_size // BLOCK))
            _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter_size, BLOCK=BLOCK,
                                       **pdl_options(x.device), num_warps=4)
        return out
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    if num_tokens > 0 and inter_size > 0:
        block = min(next_power_of_2(inter_size), 4096)
        _silu_and_mul_quant_kernel[(num_tokens,)](x, out, scale, x.stride(0), out.stride(0), inter_size, BLOCK=block,
                                                  EXACT=is_interpreting(), **pdl_options(x.device),
                                                  num_warps=8 if block >= 2048 else 4)
    elif num_tokens:
        scale.fill_(EMPTY_ROW_SCALE)
    return QuantizedRows(out, scale, x.dtype)


def silu_and_mul_ref(x, quantize=False):
    """Torch reference of `silu_and_mul` (and its CPU implementation)."""
    _check_inputs(x)
    gate, up = x.chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    return QuantizedRows.of(out, reference=True) if quantize else out


def silu_and_mul(x, quantize=False):
    """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:], [T, I] in x's dtype (quantize: as QuantizedRows)."""
    if use_triton(x):
        return silu_and_mul_triton(x, quantize)
    return silu_and_mul_ref(x, quantize)
