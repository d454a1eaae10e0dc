"""silu_and_mul: the reference against Hugging Face's Llama MLP activation, the Triton kernel against it."""

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from kernels.fp8 import QuantizedRows, quantize_per_token_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (3e-2, 2e-2)}  # see rms_norm


def make_x(num_tokens, inter, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(num_tokens, 2 * inter, generator=gen)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ref_is_hf_gated_activation(dtype):
    from transformers.activations import ACT2FN

    x = make_x(7, 50, dtype, "cpu")
    gate, up = x[:, :50], x[:, 50:]
    assert torch.equal(silu_and_mul_ref(x), ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [1, 100, 1024, 1500])  # within, at and across the 1024-wide program
def test_triton_matches_ref(dtype, inter, device, poisoned_allocations):
    x = make_x(5, inter, dtype, device)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=atol, rtol=rtol)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, under the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [100, 5000])  # one block, and several (4096 wide) per row
def test_fused_quantization_is_bitwise_silu_and_mul_then_quantize_per_token(dtype, inter, device,
                                                                           poisoned_allocations):
    x = make_x(6, inter, dtype, device)
    x[2] *= 1e-3  # rows of different magnitudes: a scale each
    for act in (silu_and_mul_triton, silu_and_mul_ref):
        values, scale = quantize_per_token_ref(act(x))
        fused = act(x, quantize=True)
        assert isinstance(fused, QuantizedRows) and fused.dtype == dtype and fused.shape == (6, inter)
        assert torch.equal(fused.values.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(fused.scale, scale)
        assert len(set(scale.tolist())) > 1
    empty = silu_and_mul_triton(x[:, :0], quantize=True)
    assert empty.shape == (6, 0) and torch.equal(empty.scale, quantize_per_token_ref(x[:, :0])[1])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, under the interpreter
def test_strided_rows_extremes_and_checks(device, poisoned_allocations):
    x = make_x(4, 64, torch.float32, device)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow must give silu = -0, not NaN
    wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, :128]  # rows 256 apart
    torch.testing.assert_close(silu_and_mul_triton(wide), silu_and_mul_ref(x))
    assert silu_and_mul_triton(x[:0]).shape == (0, 64)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_triton(x[:, :3])
    cpu_x = make_x(2, 8, torch.float32, "cpu")
    assert torch.equal(silu_and_mul(cpu_x), silu_and_mul_ref(cpu_x))


@pytest.mark.gpu
def test_gpu_llama3_8b_sizes(cuda):
    x = make_x(4096, 14336, torch.bfloat16, cuda)
    out, ref = silu_and_mul(x), silu_and_mul_ref(x)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    assert (out != ref).float().mean() < 1e-3
