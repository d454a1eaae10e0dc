"""linear_int: the decode-sized W4A16 / W8A16 Triton kernel (AWQ's and GPTQ's packings, g_idx, the gated epilogue)
against its torch reference, on weights packed as the tools pack them (tests/int4_checkpoints.py)."""

import pytest
import torch

from kernels.linear_int import AWQ_GEMM, gptq_v1, linear_int, linear_int_ref, linear_int_triton, offset_binary
from tests import int4_checkpoints as ic

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (3e-2, 3e-2)}
CONFIGS = [None, dict(BLOCK_N=16, BLOCK_K=32), dict(BLOCK_N=64, BLOCK_K=128, num_stages=3)]


def packed_layer(fmt: ic.Int4Format, out_features: int, in_features: int, device, seed: int = 0):
    """(qweight, qzeros, scales, g_idx, group_size, packing) of a random [out, in] weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    order = torch.randperm(in_features, generator=gen)
    qz = ic.quantize(w, fmt, order)
    if fmt.method == "pack-quantized":  # the layer's layout: the checkpoint's [N, ...] tensors transposed
        ct = ic.pack_compressed_tensors(qz, fmt.bits, sym=False, has_g_idx=True)
        parts = {"qweight": ct["weight_packed"].t().contiguous(), "qzeros": ct["weight_zero_point"].t().contiguous(),
                 "scales": ct["weight_scale"].t().float().contiguous(), "g_idx": ct["weight_g_idx"]}
    else:
        parts = ic.pack_awq(qz) if fmt.method == "awq" else ic.pack_gptq(qz, fmt.bits)
    packing = {"awq": AWQ_GEMM, "gptq": gptq_v1(fmt.bits), "pack-quantized": offset_binary(fmt.bits)}[fmt.method]
    g_idx = parts.get("g_idx") if fmt.desc_act else None
    group_size = None if fmt.group_size == -1 else fmt.group_size
    return dict(qweight=parts["qweight"].to(device), qzeros=parts["qzeros"].to(device),
                scales=parts["scales"].to(device), g_idx=None if g_idx is None else g_idx.to(device),
                group_size=group_size, packing=packing)


FORMATS = [ic.Int4Format("awq", 32), ic.Int4Format("gptq", 32, sym=True),
           ic.Int4Format("gptq", 32, desc_act=True), ic.Int4Format("gptq", -1, sym=True),
           ic.Int4Format("gptq", 64, bits=8, desc_act=True), ic.Int4Format("pack-quantized", 32)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("gated, bias", [(False, False), (True, False), (False, True)])
def test_triton_matches_ref(fmt, rows, gated, bias, device, poisoned_allocations):
    # 96 output features (48 a half when gated) and 192 input features: partial tiles at every config.
    layer = packed_layer(fmt, 96, 192, device)
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(rows, 192, generator=gen)).to(device)
    b = torch.randn(96, generator=gen).to(device) if bias else None
    ref = linear_int_ref(x, **layer, bias=b, gated=gated)
    for config in CONFIGS:
        out = linear_int_triton(x, **layer, bias=b, gated=gated, config=config)
        assert out.shape == ref.shape == (rows, 48 if gated else 96)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations(dtype, device, poisoned_allocations):
    layer = packed_layer(ic.Int4Format("awq", 64), 64, 128, device)
    x = torch.randn(3, 128).to(dtype).to(device)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(linear_int_triton(x, **layer), linear_int_ref(x, **layer), atol=atol, rtol=rtol)


def test_bad_inputs(device):
    layer = packed_layer(ic.Int4Format("gptq", 32), 64, 128, device)
    with pytest.raises(ValueError, match="input features"):
        linear_int_triton(torch.randn(2, 96, device=device), **layer)
    with pytest.raises(ValueError, match="qweight must have dtype"):
        linear_int_triton(torch.randn(2, 128, device=device), **{**layer, "qweight": layer["qweight"].float()})


def test_cpu_dispatch_takes_the_reference():
    """Off the GPU the public function is the reference (the interpreter is for these tests only)."""
    layer = packed_layer(ic.Int4Format("awq", 32), 32, 64, "cpu")
    x = torch.randn(2, 64)
    assert torch.equal(linear_int(x, **layer), linear_int_ref(x, **layer))


def test_mins_take_the_reference_and_add_once():
    """GGUF Q4_1's additive minimum: W = q * scale + min, rounded once in float32 (gguf's own arithmetic); the
    public function takes the reference for it (the Triton kernel has no mins path yet)."""
    from kernels.linear_int import dequantize_ref

    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (64, 16), generator=gen, dtype=torch.int32)  # [K, N]
    scales, mins = torch.rand(2, 16, generator=gen).half(), -torch.rand(2, 16, generator=gen).half()
    qweight = ic._packed(q.numpy(), 0, 4, range(8))
    w = dequantize_ref(qweight, None, scales, None, 32, offset_binary(4), torch.float32, mins)
    groups = torch.arange(64) // 32
    assert torch.equal(w, (q.float() * scales[groups].float() + mins[groups].float()).t())
    x = torch.randn(3, 64, generator=gen)
    out = linear_int(x, qweight, None, scales, None, 32, offset_binary(4), mins=mins)
    assert torch.equal(out, linear_int_ref(x, qweight, None, scales, None, 32, offset_binary(4), mins=mins))
