"""SiLU-and-mul: the gated activation of a Llama MLP, on the fused gate_up projection output.

    x = [gate | up]  [T, 2 * I]   ->   silu(gate) * up  [T, I]

Rounded as Hugging Face computes `act_fn(gate_proj(x)) * up_proj(x)` in the model dtype: silu in float32,
rounded to the dtype, then the product rounded again.
"""

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    tl,
    triton,
    use_triton,
)

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(x) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [tokens, 2 * intermediate], got shape {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)


def silu_and_mul_triton(x):
    """Triton launcher of `silu_and_mul` (rows of x may be strided)."""
    _check_inputs(x)
    check_launchable(x)
    check_last_dim_contiguous("x", x)
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter_size, dtype=x.dtype, device=x.device)
    if num_tokens > 0 and inter_size > 0:
        grid = (num_tokens, -(-inter_size // BLOCK))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter_size, BLOCK=BLOCK, num_warps=4)
    return out


def silu_and_mul_ref(x):
    """Torch reference of `silu_and_mul` (and its CPU implementation)."""
    _check_inputs(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(x):
    """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:], [T, I] in x's dtype."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
