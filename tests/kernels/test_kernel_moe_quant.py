"""Fused MoE over quantized experts: the reference is kernels/moe.py's over the dequantized weights (bit for bit), and
the Triton kernel, which dequantizes each weight tile in registers, matches it across packings (AWQ, GPTQ v1 with
and without act-order, 8 bits, compressed-tensors' offset binary, one group), FP8 per-row and per-block scales, and
shapes that cross tile, group and scale-block boundaries. The experts are packed by checkpoints/int4_rtn.py, as the
tools pack them."""

import dataclasses
import functools

import pytest
import torch

from checkpoints import int4_rtn as ic
from kernels.fp8 import quantize_weight, quantize_weight_blocks
from kernels.linear_int import AWQ_GEMM, gptq_v1, offset_binary
from kernels.moe import fused_moe_ref, topk_route
from kernels.moe_quant import (
    Fp8Experts,
    IntExperts,
    _fp8_linear_ref,
    fused_moe_quant,
    fused_moe_quant_ref,
    fused_moe_quant_triton,
)

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (3e-2, 3e-2)}


def _packed_layer(w: torch.Tensor, fmt: ic.Int4Format, order: torch.Tensor | None) -> dict:
    """One expert's [N, K] weight quantized and packed as the tool packs it, in the int layers' K-first layout
    (compressed-tensors' N-first tensors transposed, as the layers hold them)."""
    qz = ic.quantize(w, fmt, order)
    if fmt.method == "pack-quantized":
        parts = ic.pack_compressed_tensors(qz, fmt.bits, sym=False, has_g_idx=True)
        return {"qweight": parts["weight_packed"].t().contiguous(),
                "qzeros": parts["weight_zero_point"].t().contiguous(),
                "scales": parts["weight_scale"].t().contiguous().float(), "g_idx": qz.g_idx}
    parts = ic.pack(qz, fmt)
    return {**parts, "g_idx": qz.g_idx}


def int_experts(w: torch.Tensor, fmt: ic.Int4Format, seed: int = 0) -> IntExperts:
    """w [E, N, K] float -> IntExperts; act-order: one random order per expert (gate and up share it: stacked)."""
    gen = torch.Generator().manual_seed(seed)
    layers = [_packed_layer(w[e], fmt, torch.randperm(w.shape[2], generator=gen)) for e in range(w.shape[0])]
    stacked = {name: torch.stack([layer[name] for layer in layers]) for name in ("qweight", "qzeros", "scales")}
    packing = {"awq": AWQ_GEMM, "gptq": gptq_v1(fmt.bits), "pack-quantized": offset_binary(fmt.bits)}[fmt.method]
    has_g_idx = fmt.desc_act
    return IntExperts(**stacked, g_idx=torch.stack([layer["g_idx"] for layer in layers]) if has_g_idx else None,
                      group_size=None if fmt.group_size == -1 else fmt.group_size, packing=packing)


def fp8_experts(w: torch.Tensor, block_size=None, parts: int = 1) -> Fp8Experts:
    weights, scales = [], []
    for e in range(w.shape[0]):
        if block_size is None:
            q, s = quantize_weight(w[e])
        else:
            pieces = [quantize_weight_blocks(p, block_size) for p in w[e].chunk(parts)]
            q, s = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        weights.append(q)
        scales.append(s)
    return Fp8Experts(torch.stack(weights), torch.stack(scales), block_size, parts)


def make_case(num_tokens, hidden, inter, num_experts, top_k, quantize13, quantize2, dtype, device, skew=1.0,
              seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += skew
    weights, ids = topk_route(logits, top_k, True)
    q13, q2 = quantize13(w13), quantize2(w2)
    moved = [dataclasses.replace(q, **{f.name: getattr(q, f.name).to(device) for f in dataclasses.fields(q)
                                       if isinstance(getattr(q, f.name), torch.Tensor)}) for q in (q13, q2)]
    return x.to(device), moved[0], moved[1], weights.to(device), ids.to(device)


INT_FORMATS = [ic.Int4Format("awq", 32), ic.Int4Format("awq", 64), ic.Int4Format("gptq", 32, sym=True),
               ic.Int4Format("gptq", 32, desc_act=True), ic.Int4Format("gptq", -1, sym=True),
               ic.Int4Format("gptq", 32, bits=8, desc_act=True), ic.Int4Format("pack-quantized", 32)]


def _int(fmt):
    return lambda w: int_experts(w, fmt)


@pytest.mark.parametrize("fmt", INT_FORMATS[:3], ids=lambda f: f.name)
def test_reference_is_the_unquantized_reference_on_dequantized_weights(fmt):
    x, w13, w2, weights, ids = make_case(9, 64, 64, 4, 2, _int(fmt), _int(fmt), torch.float32, "cpu")
    dense13 = torch.stack([w13.dequantize(e, torch.float32) for e in range(4)])
    dense2 = torch.stack([w2.dequantize(e, torch.float32) for e in range(4)])
    assert torch.equal(fused_moe_quant_ref(x, w13, w2, weights, ids), fused_moe_ref(x, dense13, dense2, weights, ids))
    assert torch.equal(fused_moe_quant(x, w13, w2, weights, ids), fused_moe_ref(x, dense13, dense2, weights, ids))


# (tokens, hidden, inter, experts, top_k): decode-sized to several tiles per expert; hidden / inter not multiples of
# BLOCK_N; the last too many pairs x experts for the one-program alignment
SHAPES = [(1, 64, 64, 4, 2), (5, 128, 64, 8, 2), (40, 64, 96, 4, 1), (80, 64, 32, 64, 4)]


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_int_kernel_matches_the_reference(fmt, shape, device, poisoned_allocations):
    args = make_case(*shape, _int(fmt), _int(fmt), torch.float32, device)
    out = fused_moe_quant_triton(*args)
    assert not out.isnan().any(), "a row of the output was not written"
    torch.testing.assert_close(out, fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)


STREAM_FORMATS = [ic.Int4Format("awq", 32), ic.Int4Format("gptq", 128, sym=True),
                  ic.Int4Format("gptq", 64, bits=8), ic.Int4Format("pack-quantized", 128, sym=True)]


@pytest.mark.parametrize("fmt, num_tokens", [(STREAM_FORMATS[0], 3)] + [(f, 1) for f in STREAM_FORMATS[1:]],
                         ids=lambda c: c.name if isinstance(c, ic.Int4Format) else str(c))
def test_int_decode_stream_matches_the_reference(fmt, num_tokens, device, poisoned_allocations, monkeypatch):
    """Decode-sized batches of the layouts kernels/moe_int_decode.py streams (AWQ's along N; GPTQ's and
    pack-quantized's along K, 4 and 8 bits): each launch taken there, K split into slices the tile's last program
    adds up (AWQ's cases: their K tiles of 32 make enough slices at these sizes); equal to the reference and to
    kernels/moe_quant.py's GEMM."""
    from kernels import moe_int_decode

    launches = []
    real = moe_int_decode._moe_int_stream_kernel

    class Spy:  # records each launch's split of K
        def __getitem__(self, grid):
            launches.append(grid[1])
            return real[grid]

    monkeypatch.setattr(moe_int_decode, "_moe_int_stream_kernel", Spy())
    hidden = 128 if fmt.method == "awq" else 256  # AWQ's K tiles here are 32: four of them make two slices
    args = make_case(num_tokens, hidden, 128, 4, 2, _int(fmt), _int(fmt), torch.float32, device)
    out = fused_moe_quant_triton(*args)
    assert len(launches) == 2, launches  # gate/up and down
    if fmt.method == "awq":  # K tiles of 32 here: K split (the slices' sum is the same code for both layouts)
        assert max(launches) > 1, launches
    torch.testing.assert_close(out, fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)
    monkeypatch.setattr(moe_int_decode, "STREAM", False)
    torch.testing.assert_close(out, fused_moe_quant_triton(*args), atol=2e-5, rtol=2e-5)
    assert len(launches) == 2


def gguf_experts(w: torch.Tensor, qtype: str) -> IntExperts:
    """w [E, N, K] float -> IntExperts holding each expert quantized by gguf's own quantizer to `qtype` and repacked
    as a served GGUF layer holds it (checkpoints/gguf_blocks.py: K-first, groups of 32, minimums or mid-range
    zeros)."""
    import gguf

    from checkpoints.gguf_blocks import decode_blocks, pack_along_k
    from checkpoints.gguf_types import INT_LAYOUTS
    from workers.layers.quantization_int import _mid_range_zeros

    layout, qtype_id = INT_LAYOUTS[qtype], gguf.GGMLQuantizationType[qtype]
    size = gguf.GGML_QUANT_SIZES[qtype_id][1]
    parts: dict[str, list] = {"qweight": [], "scales": [], "mins": []}
    for expert in w:
        raw = gguf.quants.quantize(expert.numpy(), qtype_id)
        q, scale, low = decode_blocks(qtype, raw.reshape(raw.shape[0], -1, size))
        parts["qweight"].append(pack_along_k(q, layout.bits).t())
        parts["scales"].append(torch.from_numpy(scale).t())
        if low is not None:
            parts["mins"].append(torch.from_numpy(low).t())
    stacked = {name: torch.stack(values).contiguous() for name, values in parts.items() if values}
    packing = offset_binary(layout.bits)
    zeros = None if layout.has_mins else _mid_range_zeros(
        (w.shape[0], stacked["scales"].shape[1], w.shape[1] // packing.pack_factor), packing, "cpu")
    return IntExperts(stacked["qweight"], zeros, stacked["scales"], None, layout.group_size, packing,
                      stacked.get("mins"))


@pytest.mark.parametrize("w13_type, w2_type, shape", [("Q4_1", "Q4_1", SHAPES[1]), ("Q8_0", "Q5_1", SHAPES[0]),
                                                      ("Q5_1", "Q4_0", (40, 64, 96, 4, 1))], ids=str)
def test_gguf_experts_match_the_reference(w13_type, w2_type, shape, device, poisoned_allocations):
    """GGUF blocks as int experts (a layer's two projections may be of different types): minimums added (Q4_1, 4
    bits; Q5_1, 8), zero points (Q4_0, Q8_0); the reference equals gguf's own dequantization of the blocks."""
    import gguf

    x, w13, w2, weights, ids = make_case(*shape, lambda w: gguf_experts(w, w13_type),
                                         lambda w: gguf_experts(w, w2_type), torch.float32, device)
    w = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    for qtype in {w13_type, w2_type}:
        held, qtype_id = gguf_experts(w, qtype), gguf.GGMLQuantizationType[qtype]
        for e in range(2):
            assert torch.equal(held.dequantize(e, torch.float32), torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(w[e].numpy(), qtype_id), qtype_id))), qtype
    assert (w13.mins is not None) == (w13_type in ("Q4_1", "Q5_1"))
    out = fused_moe_quant_triton(x, w13, w2, weights, ids)
    assert not out.isnan().any(), "a row of the output was not written"
    torch.testing.assert_close(out, fused_moe_quant_ref(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("w13_type, w2_type, num_tokens", [("Q4_1", "Q8_0", 1), ("Q5_1", "Q4_0", 3)], ids=str)
def test_gguf_experts_stream_at_decode_sizes(w13_type, w2_type, num_tokens, device, poisoned_allocations,
                                             monkeypatch):
    """GGUF experts at decode sizes take kernels/moe_int_decode.py (groups of 32 inside its K tiles of 128: each
    word row's scales and mins or zeros applied before the dots), equal to the reference and to the GEMM."""
    from kernels import moe_int_decode

    launches = []
    real = moe_int_decode._moe_int_stream_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(moe_int_decode, "_moe_int_stream_kernel", Spy())
    args = make_case(num_tokens, 256, 128, 4, 2, lambda w: gguf_experts(w, w13_type),
                     lambda w: gguf_experts(w, w2_type), torch.float32, device)
    out = fused_moe_quant_triton(*args)
    assert len(launches) == 2, launches  # gate/up and down
    torch.testing.assert_close(out, fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)
    monkeypatch.setattr(moe_int_decode, "STREAM", False)
    torch.testing.assert_close(out, fused_moe_quant_triton(*args), atol=2e-5, rtol=2e-5)
    assert len(launches) == 2


@pytest.mark.parametrize("shape", SHAPES[2:], ids=str)
def test_int_kernel_at_batch_sizes_past_one_tile(shape, device, poisoned_allocations):
    fmt = ic.Int4Format("gptq", 32, desc_act=True)
    args = make_case(*shape, _int(fmt), _int(fmt), torch.float32, device)
    torch.testing.assert_close(fused_moe_quant_triton(*args), fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)


# Each format with each K tile and each unpacking, in 4 cases rather than all 8 (each is seconds under the interpreter).
# The two 16-row-K cases (15 s each on 2 cores) run in make test-slow (CI runs both suites).
TILE_CASES = [pytest.param(ic.Int4Format("awq", 32), 16, True, marks=pytest.mark.slow),
              (ic.Int4Format("awq", 32), 64, False),
              pytest.param(ic.Int4Format("gptq", 32, bits=8, desc_act=True), 16, False, marks=pytest.mark.slow),
              (ic.Int4Format("gptq", 32, bits=8, desc_act=True), 64, True)]


@pytest.mark.parametrize("fmt,block_k,unpack_once", TILE_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_tile_configs_never_change_results(fmt, block_k, unpack_once, device, poisoned_allocations):
    """K tiles inside a group of 32 (one row of zeros and scales) and across groups (gathered), 16 and 64 tile
    rows, each packed word loaded per element or once; the tiles of pairs walked 3 at a time (a last group cut
    short) or one by one (GROUP_M 1)."""
    args = make_case(45, 64, 64, 6, 2, _int(fmt), _int(fmt), torch.float32, device, skew=6.0)
    for block_m, group_m in ((16, 3), (64, 1), (16, 1)):
        config = {"BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": block_k, "UNPACK_ONCE": unpack_once,
                  "GROUP_M": group_m}
        out = fused_moe_quant_triton(*args, config=config)
        torch.testing.assert_close(out, fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int_kernel_in_half_precision(dtype, device, poisoned_allocations):
    fmt = ic.Int4Format("gptq", 64, sym=False)
    args = make_case(21, 128, 64, 4, 2, _int(fmt), _int(fmt), dtype, device)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(fused_moe_quant_triton(*args), fused_moe_quant_ref(*args), atol=atol, rtol=rtol)


FP8_CASES = {"per-row": (None, None), "block 16x32": ((16, 32), (16, 32)), "block 128x128": ((128, 128), (128, 128))}


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
@pytest.mark.parametrize("shape", [(3, 64, 48, 4, 2), (37, 96, 80, 4, 2)], ids=str)
def test_fp8_kernel_matches_the_reference(case, shape, device, poisoned_allocations):
    """Gate's and up's rows with their own scale blocks (48 / 80 rows: a partial block at the end of each)."""
    b13, b2 = FP8_CASES[case]
    args = make_case(*shape, lambda w: fp8_experts(w, b13, 2), lambda w: fp8_experts(w, b2), torch.float32, device)
    out = fused_moe_quant_triton(*args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)


def test_fp8_128_blocks_over_several_block_columns(device, poisoned_allocations):
    """Qwen3-30B-A3B-FP8's blocks over K of two blocks and more (hidden 256; 160 intermediate: a whole block and
    a partial one, in gate's and up's rows and in down's K)."""
    blocks = (128, 128)
    args = make_case(6, 256, 160, 4, 2, lambda w: fp8_experts(w, blocks, 2), lambda w: fp8_experts(w, blocks),
                     torch.float32, device)
    assert args[1].scale.shape == (4, 4, 2) and args[2].scale.shape == (4, 2, 2)
    torch.testing.assert_close(fused_moe_quant_triton(*args), fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["per-row", "block 16x32"], ids=str)
def test_fp8_static_input_scales(case, device, poisoned_allocations):
    """A checkpoint's static input scales (one a projection, powers of two): each GEMM's input quantized by it, the
    largest |x| and |h| beyond 448 times it clamped; the kernel equals the reference, and the result is not what
    per-token scales give."""
    b13, b2 = FP8_CASES[case]
    x, w13, w2, weights, ids = make_case(37, 96, 80, 4, 2, lambda w: fp8_experts(w, b13, 2),
                                         lambda w: fp8_experts(w, b2), torch.float32, device)
    static13, static2 = (dataclasses.replace(w, input_scale=torch.tensor([scale], device=device))
                         for w, scale in ((w13, 2.0 ** -7), (w2, 2.0 ** -9)))
    assert (x.abs() > 448 * 2.0 ** -7).any()  # some clamp
    args = (x, static13, static2, weights, ids)
    out = fused_moe_quant_triton(*args)
    torch.testing.assert_close(out, fused_moe_quant_ref(*args), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(out, fused_moe_quant_ref(x, w13, w2, weights, ids), atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="input_scale must hold one value"):
        two = dataclasses.replace(w13, input_scale=torch.ones(2, device=device))
        fused_moe_quant_triton(x, two, static2, weights, ids)


def test_fp8_reference_dequantizes_each_part_with_its_blocks():
    w = torch.randn(2, 2 * 24, 64)
    experts = fp8_experts(w, (16, 32), parts=2)
    assert experts.scale.shape == (2, 4, 2)  # 24 rows: 2 blocks of gate, 2 of up
    for e in range(2):
        err = (experts.dequantize(e, torch.float32) - w[e]).abs().max()
        assert 0 < err < 0.1 * w.abs().max()


def assert_fp8_moe_close(out, args, max_rows: int = 2):
    """FP8 experts in 16 bits: out equals the reference within TOL but in at most max_rows tokens' rows, and there
    by at most one e4m3 step of the largest SiLU-and-mul output h times down's largest weight. The kernel's float32
    sums (in another order than the reference's) now and then round otherwise to 16 bits; an h that does may then
    land on the neighbouring e4m3 value when it is quantized for down (a step: at most 2^-3 of the value)."""
    x, w13, w2, _, ids = args
    ref = fused_moe_quant_ref(*args)
    atol, rtol = TOL[out.dtype]
    far = ~torch.isclose(out.float(), ref.float(), atol=atol, rtol=rtol)
    rows = far.any(dim=1).nonzero().flatten().tolist()
    assert len(rows) <= max_rows, rows
    if rows:
        h_max = w2_max = 0.0
        for e in ids.unique().tolist():
            gate, up = _fp8_linear_ref(w13)(x, w13.dequantize(e, torch.float32)).chunk(2, dim=-1)
            h_max = max(h_max, (torch.nn.functional.silu(gate) * up).float().abs().max().item())
            w2_max = max(w2_max, w2.dequantize(e, torch.float32).abs().max().item())
        bound = atol + 2 ** -3 * h_max * w2_max
        assert (out.float() - ref.float()).abs().max() <= bound, (rows, bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kernel_in_half_precision(dtype, device, poisoned_allocations):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("Triton's interpreter converts float32 to bfloat16 by truncating (half of randn's values round "
                    "otherwise than torch's nearest-even), which the FP8 quantization of h then amplifies; "
                    "bfloat16 runs on the GPU (here, and test_gpu_real_sizes)")
    args = make_case(21, 64, 48, 4, 2, lambda w: fp8_experts(w, (16, 32), 2), lambda w: fp8_experts(w, (16, 32)),
                     dtype, device)
    assert_fp8_moe_close(fused_moe_quant_triton(*args), args)


def test_launcher_rejects_bad_inputs(device):
    fmt = ic.Int4Format("awq", 32)
    x, w13, w2, weights, ids = make_case(4, 64, 32, 4, 2, _int(fmt), _int(fmt), torch.float32, device)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_quant_triton(x, w13, w13, weights, ids)
    with pytest.raises(ValueError, match="scales must be"):
        fused_moe_quant_triton(x, IntExperts(w13.qweight, w13.qzeros, w13.scales[:, :, :8], None, 32, AWQ_GEMM), w2,
                               weights, ids)
    fp8 = fp8_experts(torch.randn(4, 64, 64), (16, 24), parts=2)
    with pytest.raises(ValueError, match="both be FP8 experts or both integer"):
        fused_moe_quant_triton(x, fp8, w2, weights, ids)
    with pytest.raises(ValueError, match="below tl.dot's 16"):  # a K tile of 8 columns
        fused_moe_quant_triton(x, fp8, fp8_experts(torch.randn(4, 64, 32)), weights, ids)


@pytest.mark.slow  # the benchmark at toy sizes under the interpreter: make test-slow and CI run it
def test_benchmark_cases_run_under_the_interpreter(device):
    """benchmarks/kernels_moe_quant.py at toy sizes (its GPU run is the lead's): every format builds, checks the
    kernel against the reference and times it."""
    import benchmarks.kernels as bench
    from benchmarks.kernels_moe_quant import FORMATS, bench_moe_quant

    runner = bench.Runner(device, check=True, use_triton=True)
    bench_moe_quant(runner, {"dtype": torch.bfloat16}, dict(hidden=128, inter=128, num_experts=4, top_k=2, rows=[2]))
    assert not runner.failures, runner.failures
    assert {(r["case"], r["impl"]) for r in runner.results} == {(f"{fmt} rows 2", impl) for fmt in FORMATS
                                                                for impl in ("bf16 triton", "triton", "torch ref")}


SHAPES_GPU = {"mixtral": dict(hidden=4096, inter=14336, num_experts=8, top_k=2),
              "qwen3-moe": dict(hidden=2048, inter=768, num_experts=128, top_k=8)}
GPU_FORMATS = {"awq g128": (_int(ic.Int4Format("awq", 128)), _int(ic.Int4Format("awq", 128))),
               "gptq act-order": (_int(ic.Int4Format("gptq", 128, desc_act=True)),
                                  _int(ic.Int4Format("gptq", 128, desc_act=True))),
               "fp8 per-row": (lambda w: fp8_experts(w, None, 2), fp8_experts),
               "fp8 128x128": (lambda w: fp8_experts(w, (128, 128), 2), lambda w: fp8_experts(w, (128, 128)))}


@functools.lru_cache(maxsize=2)  # a real-sized layer's experts, packed once for the cases that share them
def _gpu_experts(shape_name: str, fmt: str, device: str):
    shape = SHAPES_GPU[shape_name]
    gen = torch.Generator().manual_seed(0)
    hidden, inter, num_experts = shape["hidden"], shape["inter"], shape["num_experts"]
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    q13, q2 = (quantize(w) for quantize, w in zip(GPU_FORMATS[fmt], (w13, w2)))
    return [dataclasses.replace(q, **{f.name: getattr(q, f.name).to(device) for f in dataclasses.fields(q)
                                      if isinstance(getattr(q, f.name), torch.Tensor)}) for q in (q13, q2)]


def _gpu_case(shape_name: str, num_tokens: int, fmt: str, cuda, seed: int = 0):
    shape = SHAPES_GPU[shape_name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, shape["hidden"], generator=gen).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(num_tokens, shape["num_experts"], generator=gen), shape["top_k"], True)
    w13, w2 = _gpu_experts(shape_name, fmt, str(cuda))
    return x.to(cuda), w13, w2, weights.to(cuda), ids.to(cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, num_tokens", [("mixtral", 1), ("mixtral", 64), ("mixtral", 1000), ("qwen3-moe", 16)],
                         ids=["mixtral-1", "mixtral-64", "mixtral-1000", "qwen3-moe-16"])
@pytest.mark.parametrize("fmt", GPU_FORMATS)  # the outer loop: a format's experts are packed once
def test_gpu_real_sizes(fmt, shape, num_tokens, cuda):
    """Mixtral's and Qwen3-30B-A3B's experts, decode (16-row tiles) and prefill (64-row tiles, words unpacked
    once) sizes, against the reference on the GPU."""
    args = _gpu_case(shape, num_tokens, fmt, cuda)
    if fmt.startswith("fp8"):
        assert_fp8_moe_close(fused_moe_quant(*args), args, max_rows=max(2, num_tokens // 10))
    else:
        torch.testing.assert_close(fused_moe_quant(*args), fused_moe_quant_ref(*args), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq g128", "fp8 128x128"])
def test_gpu_decode_in_a_cuda_graph(fmt, cuda):
    """A decode step's quantized MoE as the engine runs it: captured once, replayed with other routings."""
    x, w13, w2, weights, ids = _gpu_case("qwen3-moe", 4, fmt, cuda)
    fused_moe_quant(x, w13, w2, weights, ids)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_quant(x, w13, w2, weights, ids)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed + 1)
        new_weights, new_ids = topk_route(torch.randn(4, 128, generator=gen), 8, True)
        weights.copy_(new_weights.to(cuda))
        ids.copy_(new_ids.to(cuda))
        graph.replay()
        if fmt.startswith("fp8"):
            assert_fp8_moe_close(out, (x, w13, w2, weights, ids))
        else:
            torch.testing.assert_close(out, fused_moe_quant_ref(x, w13, w2, weights, ids), atol=3e-2, rtol=3e-2)
