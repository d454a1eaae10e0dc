"""linear: the decode-sized Triton kernel (with the gated SiLU-and-mul epilogue) against its torch reference,
and the dispatch between it and cuBLAS."""

import pytest
import torch

import kernels.linear as linear_module
from kernels.linear import linear, linear_ref, linear_triton

# The dot product sums in another order than torch's; bf16 / fp16 outputs may then round one ulp apart, and the
# interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (3e-2, 3e-2)}
CONFIGS = [None, dict(BLOCK_N=16, BLOCK_K=64), dict(BLOCK_N=32, BLOCK_K=128, num_stages=2)]


def make_inputs(rows, out_rows, in_features, dtype, device, gated=False, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)

    weight_rows = 2 * out_rows if gated else out_rows
    return dict(x=randn(rows, in_features, scale=3.0),
                weight=randn(weight_rows, in_features, scale=in_features ** -0.5),
                bias=randn(weight_rows) if bias else None, gated=gated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matches_ref(dtype, rows, gated, bias, device, poisoned_allocations):
    # 40 output features and 300 input features: partial tiles in both dimensions at every config.
    inputs = make_inputs(rows, 40, 300, dtype, device, gated, bias)
    before = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    ref = linear_ref(**inputs)
    atol, rtol = TOL[dtype]
    for config in CONFIGS:
        out = linear_triton(**inputs, config=config)
        assert out.shape == ref.shape == (rows, 40) and out.dtype == dtype
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for name, value in before.items():  # inputs untouched
        assert torch.equal(inputs[name], value), name


def test_strided_input_rows(device, poisoned_allocations):
    """Rows of x may lie apart (a slice of a wider tensor)."""
    x = torch.randn(5, 2 * 96, device=device)[:, :96]
    weight = torch.randn(48, 96, device=device) / 10
    torch.testing.assert_close(linear_triton(x, weight), linear_ref(x, weight), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear_triton(x, weight, gated=True), linear_ref(x, weight, gated=True),
                               atol=1e-4, rtol=1e-4)


def test_no_rows(device):
    inputs = make_inputs(0, 16, 32, torch.float32, device, gated=True)
    assert linear_triton(**inputs).shape == (0, 16)


def test_bad_inputs(device):
    inputs = make_inputs(2, 16, 32, torch.float32, device)
    x, weight = inputs["x"], inputs["weight"]
    with pytest.raises(ValueError, match="must agree"):
        linear_triton(x[:, :16], weight)
    with pytest.raises(ValueError, match="weight dtype"):
        linear_triton(x, weight.half())
    with pytest.raises(ValueError, match="even row count"):
        linear_triton(x, weight[:15], gated=True)
    with pytest.raises(ValueError, match="bias must be"):
        linear_triton(x, weight, bias=torch.zeros(3, device=device))


def test_cpu_dispatch_is_the_reference():
    inputs = make_inputs(3, 16, 32, torch.bfloat16, "cpu", gated=True, bias=True)
    assert torch.equal(linear(**inputs), linear_ref(**inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, linear_module.MAX_ROWS, linear_module.MAX_ROWS + 1])
def test_gpu_llama3_8b_layer(rows, cuda):
    """A Llama-3-8B layer's projections through the public call: the Triton kernel up to MAX_ROWS, cuBLAS beyond."""
    for out_rows, in_features, gated in [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
                                         (4096, 14336, False)]:
        inputs = make_inputs(rows, out_rows, in_features, torch.bfloat16, cuda, gated)
        out, ref = linear(**inputs), linear_ref(**inputs)
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
        assert (out != ref).float().mean() < 0.05  # most elements round the same
