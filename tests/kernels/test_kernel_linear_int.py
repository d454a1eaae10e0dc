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


def test_mins_add_once():
    """GGUF Q4_1's additive minimum: W = q * scale + min, rounded once in float32 (gguf's own arithmetic)."""
    from kernels.linear_int import dequantize_ref

    layer = q4_1_layer(64, 16, "cpu")
    w = dequantize_ref(layer["qweight"], None, layer["scales"], None, 32, offset_binary(4), torch.float32,
                       layer["mins"])
    groups = torch.arange(64) // 32
    q = layer["q"]
    assert torch.equal(w, (q.float() * layer["scales"][groups].float() + layer["mins"][groups].float()).t())


def q4_1_layer(in_features: int, out_features: int, device, seed: int = 2) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (in_features, out_features), generator=gen, dtype=torch.int32)  # [K, N]
    groups = in_features // 32
    scales = (torch.rand(groups, out_features, generator=gen) / 8).half()
    mins = (-torch.rand(groups, out_features, generator=gen)).half()
    return dict(qweight=ic._packed(q.numpy(), 0, 4, range(8)).to(device), scales=scales.to(device),
                mins=mins.to(device), q=q)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("gated", [False, True])
def test_triton_mins_match_ref(rows, gated, device, poisoned_allocations):
    """Q4_1's path in the kernel (one group per tile and, at BLOCK_K 64 over groups of 32, the gather)."""
    layer = q4_1_layer(192, 96, device)
    args = dict(qweight=layer["qweight"], qzeros=None, scales=layer["scales"], g_idx=None, group_size=32,
                packing=offset_binary(4), mins=layer["mins"])
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(3)).to(device)
    ref = linear_int_ref(x, **args, gated=gated)
    for config in CONFIGS:
        torch.testing.assert_close(linear_int_triton(x, **args, gated=gated, config=config), ref, atol=1e-4,
                                   rtol=1e-4)
