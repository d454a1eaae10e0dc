"""rms_norm: the reference against Hugging Face's LlamaRMSNorm, the Triton kernel against the reference."""

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, QuantizedRows, quantize_per_token_ref
from kernels.rms_norm import rms_norm, rms_norm_ref, rms_norm_triton

# fp16: one ulp (the sum of squares is reduced in another order than torch's). bf16: the interpreter truncates
# float32 -> bfloat16 where a GPU rounds to nearest even, so bf16 results there may differ by two bf16 ulps.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1.5e-3), torch.bfloat16: (3e-2, 2e-2)}


def make_inputs(num_tokens, hidden, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(num_tokens, hidden, generator=gen)).to(dtype).to(device)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ref_is_hf_llama_rms_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual, weight = make_inputs(11, 96, dtype, "cpu")
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    assert torch.equal(rms_norm_ref(x, weight, 1e-5), hf(x))
    hidden = residual + x  # HF's decoder layer: hidden = residual + hidden; hidden = norm(hidden)
    out, new_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, hidden)
    assert torch.equal(out, hf(hidden))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_ref(dtype, hidden, with_residual, device, poisoned_allocations):
    x, residual, weight = make_inputs(13, hidden, dtype, device)
    x_before, residual_before = x.clone(), residual.clone()
    atol, rtol = TOL[dtype]
    if with_residual:
        out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
        ref, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
        torch.testing.assert_close(new_residual, ref_residual, atol=atol, rtol=rtol)
    else:
        out, ref = rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_quantization_is_bitwise_the_norm_then_quantize_per_token(dtype, with_residual, device,
                                                                       poisoned_allocations):
    """quantize=True: the e4m3 values and scales quantize_per_token gives of the unfused output, bit for bit (the
    kernel against itself unfused, and the reference against itself), and the same residual."""
    x, residual, weight = make_inputs(13, 1000, dtype, device)
    x[3] *= 1e-3  # rows of very different magnitudes: a scale each
    residual = residual if with_residual else None
    for norm in (rms_norm_triton, rms_norm_ref):
        plain = norm(x, weight, 1e-6, residual)
        fused = norm(x, weight, 1e-6, residual, quantize=True)
        if with_residual:
            (plain, plain_residual), (fused, fused_residual) = plain, fused
            assert torch.equal(fused_residual, plain_residual)
        values, scale = quantize_per_token_ref(plain)
        assert isinstance(fused, QuantizedRows) and fused.dtype == dtype and fused.shape == x.shape
        assert fused.values.dtype == FP8_DTYPE and fused.scale.dtype == torch.float32
        assert torch.equal(fused.values.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(fused.scale, scale)
        assert len(set(scale.tolist())) > 1


def test_triton_strided_rows_and_float32_weight(device, poisoned_allocations):
    x = torch.randn(6, 2 * 48, device=device)[:, :48]  # rows 96 apart
    weight = torch.rand(48, device=device)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    out = rms_norm_triton(x.half(), weight, 1e-6)  # fp32 weight, fp16 activations: output stays fp16
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, rms_norm_ref(x.half(), weight, 1e-6), atol=1e-3, rtol=1e-3)


def test_bad_inputs_and_cpu_dispatch(device):
    x, residual, weight = make_inputs(3, 32, torch.float32, device)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(x, weight[:16], 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_triton(x, weight, 1e-6, residual.half())
    with pytest.raises(ValueError, match="x must be"):
        rms_norm_triton(x[0], weight, 1e-6)
    x, residual, weight = make_inputs(3, 32, torch.float32, "cpu")
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4096])
def test_gpu_llama3_8b_sizes(num_tokens, cuda):
    x, residual, weight = make_inputs(num_tokens, 4096, torch.bfloat16, cuda)
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    ref, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)  # rsqrt.approx may move a rounding
    assert (out != ref).float().mean() < 1e-2
