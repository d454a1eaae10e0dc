"""linear_int: the decode-sized W4A16 / W8A16 Triton kernel (AWQ's and GPTQ's packings, g_idx, the gated epilogue)
against its torch reference, on weights packed as the tools pack them (checkpoints/int4_rtn.py)."""

import functools
import os

import pytest
import torch

from checkpoints import int4_rtn as ic
from kernels.linear_int import AWQ_GEMM, gptq_v1, linear_int, linear_int_ref, linear_int_triton, offset_binary

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
    packing = ic_packing(fmt)
    g_idx = parts.get("g_idx") if fmt.desc_act else None
    group_size = None if fmt.group_size == -1 else fmt.group_size
    return dict(qweight=parts["qweight"].to(device), qzeros=parts["qzeros"].to(device),
                scales=parts["scales"].to(device), g_idx=None if g_idx is None else g_idx.to(device),
                group_size=group_size, packing=packing)


def ic_packing(fmt: ic.Int4Format):
    """The layer packing of a test format (`packed_layer`'s)."""
    return {"awq": AWQ_GEMM, "gptq": gptq_v1(fmt.bits), "pack-quantized": offset_binary(fmt.bits)}[fmt.method]


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


@pytest.mark.parametrize("packing", [gptq_v1(4), offset_binary(4)], ids=["gptq-v1", "offset-binary"])
def test_along_n_holds_the_same_weights(packing, device, poisoned_allocations):
    """A 4-bit layer packed along K repacked along N in AWQ's order (what an int linear holds after loading):
    random words (every field value, v1's stored 15 a zero of 16 included) dequantize to the same weight bit for
    bit, a chunk of word rows at a time as at once, and both layouts' kernels give the same output."""
    from kernels.linear_int import AWQ_FIELDS, along_n, dequantize_ref, pack_int32, unpack_int32

    gen = torch.Generator().manual_seed(5)
    k, n, group = 256, 96, 32
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32).to(device)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), generator=gen, dtype=torch.int32).to(device)
    scales = (torch.rand(k // group, n, generator=gen) / 64).half().to(device)
    qw, qz, along = along_n(qweight, qzeros, packing, rows_at_once=3)
    assert (along.is_packed_along_k, along.fields, along.zero_offset) == (False, AWQ_FIELDS, packing.zero_offset)
    assert qw.shape == (k, n // 8) and qz.shape == qzeros.shape
    assert torch.equal(dequantize_ref(qw, qz, scales, None, group, along, torch.float32),
                       dequantize_ref(qweight, qzeros, scales, None, group, packing, torch.float32))
    assert torch.equal(along_n(qweight, qzeros, packing)[0], qw)
    assert torch.equal(pack_int32(unpack_int32(qw, 4, False, AWQ_FIELDS), 4, False, AWQ_FIELDS), qw)
    assert torch.equal(pack_int32(unpack_int32(qweight, 4, True), 4, True), qweight)  # unpack_int32's inverse
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16).to(device)
    ref = linear_int_ref(x.float(), qweight, qzeros, scales, None, group, packing)
    for out in (linear_int_triton(x, qw, qz, scales, None, group, along),  # the stream kernel, each layout
                linear_int_triton(x, qweight, qzeros, scales, None, group, packing)):
        assert (out.float() - ref).abs().max() <= 2 * 2.0 ** -8 * ref.abs().max()
    # past the stream's rows: the dequantizing kernel (bit for bit) and the GEMM tiles
    from kernels.linear_int import dequantize_triton

    assert torch.equal(dequantize_triton(qw, qz, scales, None, group, along, torch.float16),  # (the interpreter
                       dequantize_ref(qweight, qzeros, scales, None, group, packing, torch.float16))  # truncates bf16)
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16).to(device)
    ref = linear_int_ref(x.float(), qweight, qzeros, scales, None, group, packing)
    assert (linear_int_triton(x, qw, qz, scales, None, group, along).float() - ref).abs().max() <= \
        2 * 2.0 ** -8 * ref.abs().max()


@pytest.mark.parametrize("fmt", [ic.Int4Format("gptq", 32, desc_act=True),
                                 ic.Int4Format("gptq", 64, bits=8, desc_act=True)], ids=lambda f: f.name)
def test_sorted_by_group_is_the_same_layer_on_permuted_inputs(fmt, device):
    """An act-order layer with its input features sorted by group (what an int linear holds after loading): its
    weight is the original's columns in perm's order bit for bit, each feature k in group k // group_size, so x's
    permuted columns times it give x times the original; a K slice holding part of some groups (a row-parallel
    rank's) is left alone (None)."""
    from kernels.linear_int import dequantize_ref, sorted_by_group

    layer = packed_layer(fmt, 96, 256, device)
    assert layer["g_idx"] is not None
    perm, qweight, qzeros, scales = sorted_by_group(layer["qweight"], layer["qzeros"], layer["scales"],
                                                    layer["g_idx"], fmt.group_size, layer["packing"],
                                                    columns_at_once=40)
    w = dequantize_ref(**layer, dtype=torch.float32)
    w_sorted = dequantize_ref(qweight, qzeros, scales, None, fmt.group_size, layer["packing"], torch.float32)
    assert torch.equal(w_sorted, w[:, perm])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(device)
    torch.testing.assert_close(linear_int_ref(x[:, perm], qweight, qzeros, scales, None, fmt.group_size,
                                              layer["packing"]), linear_int_ref(x, **layer), atol=1e-5, rtol=1e-5)
    assert sorted_by_group(layer["qweight"][: 64 // layer["packing"].pack_factor], layer["qzeros"],
                           layer["scales"], layer["g_idx"][:64], fmt.group_size, layer["packing"]) is None


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


# The GEMM tiles (more than MAX_ROWS rows): every layout, 4 and 8 bits, groups of 32 / 64 / 128 / all of K.
GEMM_FORMATS = [ic.Int4Format("awq", 32), ic.Int4Format("awq", 128), ic.Int4Format("gptq", 64, sym=True),
                ic.Int4Format("gptq", 32, desc_act=True), ic.Int4Format("gptq", -1, sym=True),
                ic.Int4Format("gptq", 64, bits=8, desc_act=True), ic.Int4Format("gptq", 128, bits=8, sym=True),
                ic.Int4Format("pack-quantized", 32), ic.Int4Format("pack-quantized", 128, bits=8)]
# the default (gemm_config), small tiles in groups of 2 row tiles (5 row tiles of 130 rows: a last group of one),
# and a K tile wider than K (192) with each value loading its own word
GEMM_CONFIGS = [None, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, UNPACK_ONCE=False)]


def in_features_of(fmt: ic.Int4Format) -> int:
    return 384 if fmt.group_size == 128 else 192  # whole groups; K tiles of 128 and 256 cross K's end at 192


@pytest.mark.parametrize("fmt", GEMM_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [17, 130])
@pytest.mark.parametrize("gated, bias", [(False, True), (True, False)])
def test_gemm_matches_ref(fmt, rows, gated, bias, device, poisoned_allocations):
    # 96 output features: partial column tiles; gated, 48 a half, which starts AWQ's up half on a whole int32
    k = in_features_of(fmt)
    layer = packed_layer(fmt, 96, k, device)
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(rows, k, generator=gen)).to(device)
    b = torch.randn(96, generator=gen).to(device) if bias else None
    ref = linear_int_ref(x, **layer, bias=b, gated=gated)
    for config in GEMM_CONFIGS:
        out = linear_int_triton(x, **layer, bias=b, gated=gated, config=config)
        assert out.shape == ref.shape == (rows, 48 if gated else 96)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packing", [AWQ_GEMM, gptq_v1(4)], ids=["awq", "gptq-v1-along-n"])
@pytest.mark.parametrize("gated, bias", [(False, True), (True, False)])
def test_gemm_pair_tiles(packing, gated, bias, dtype, device, poisoned_allocations):
    """The GEMM tiles' 4-bit pairs path (16-bit x, AWQ's order along N: AWQ, and GPTQ v1 as held along N with its
    zero offset): random words (every field value, v1's stored 15 a zero of 16 included), the exact-weight product
    within the output's rounding, at the default tiles and at small ones (partial column tiles, groups of 2 row
    tiles); the float path (PAIRS off) as before, within W's rounding."""
    from kernels.linear_int import along_n, pair_gemm_config, pair_tiles

    gen = torch.Generator().manual_seed(6)
    k, n, group = 384, 2 * 96 if gated else 96, 128
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32)  # noqa: E731
    if packing.is_packed_along_k:
        qweight, qzeros, packing = along_n(words(k // 8, n), words(k // group, n // 8), packing)
    else:
        qweight, qzeros = words(k, n // 8), words(k // group, n // 8)
    layer = dict(qweight=qweight.to(device), qzeros=qzeros.to(device), g_idx=None, group_size=group,
                 scales=(torch.rand(k // group, n, generator=gen) / 64).half().to(device), packing=packing)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    for rows in (17, 130):
        x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
        exact = linear_int_ref(x.float(), **layer, bias=None if b is None else b.float())
        if gated:  # the epilogue rounds gate, silu(gate), up and the product to x's dtype, as silu_and_mul does
            half = exact.to(dtype)
            exact = (torch.nn.functional.silu(half[:, :96]) * half[:, 96:]).float()
        small = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=2, num_stages=2)  # mma.sync, 2 K tiles a group
        for config in (pair_gemm_config(rows, n // (2 if gated else 1), gated, group, x.device), small):
            assert pair_tiles(packing, None, group, config["BLOCK_K"], config["BLOCK_N"], dtype, None, True)
            out = linear_int_triton(x, **layer, bias=b, gated=gated, config=config | {"PAIRS": True}).float()
            assert out.shape == exact.shape == (rows, 96)
            # one rounding to 16 bits (up to 2 ulp of the largest value); the gated epilogue's four, each a
            # truncation under the interpreter against the expectation's rounding to nearest, up to 2 ulp each
            assert (out - exact).abs().max() <= (8 if gated else 2) * ulp * exact.abs().max(), (rows, config)
            atol, rtol = TOL[dtype]  # the float path: W rounded to x's dtype (truncated under the interpreter)
            rounded = linear_int_triton(x, **layer, bias=b, gated=gated, config=config | {"PAIRS": False}).float()
            torch.testing.assert_close(rounded, linear_int_ref(x, **layer, bias=b, gated=gated).float(),
                                       atol=atol * 8, rtol=rtol)
            assert not torch.equal(out, rounded)  # two paths ran: the pairs' W is exact, the float path's rounded
    # what keeps the float path: float32 x, a K tile over groups, g_idx, mins, 8 bits, along K, split words, 32
    # columns a tile
    assert not pair_tiles(packing, None, group, 64, 64, torch.float32, None, True)
    assert not pair_tiles(packing, None, 32, 64, 64, dtype, None, True)
    assert not pair_tiles(packing, torch.zeros(k, dtype=torch.int32), group, 64, 64, dtype, None, True)
    assert not pair_tiles(packing, None, group, 64, 64, dtype, layer["scales"], True)
    assert not pair_tiles(gptq_v1(4), None, group, 64, 64, dtype, None, True)
    assert not pair_tiles(offset_binary(8), None, group, 64, 64, dtype, None, True)
    assert not pair_tiles(packing, None, group, 64, 64, dtype, None, False)
    assert not pair_tiles(packing, None, group, 64, 32, dtype, None, True)
    assert pair_tiles(packing, None, group, 64, 64, dtype, None, True)


def test_gemm_awq_up_half_off_a_word(device, poisoned_allocations):
    """A gated AWQ weight whose up half starts inside an int32 (2 x 20 columns): the GEMM tiles fall back to loading
    a word per value, and still match."""
    layer = packed_layer(ic.Int4Format("awq", 32), 40, 64, device)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4)).to(device)
    torch.testing.assert_close(linear_int_triton(x, **layer, gated=True), linear_int_ref(x, **layer, gated=True),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [24, 130])
def test_gemm_mins_match_ref(rows, device, poisoned_allocations):
    """GGUF Q4_1's mins in the GEMM tiles (gathered under 64-wide K tiles over groups of 32)."""
    layer = q4_1_layer(192, 96, device)
    args = dict(qweight=layer["qweight"], qzeros=None, scales=layer["scales"], g_idx=None, group_size=32,
                packing=offset_binary(4), mins=layer["mins"])
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(3)).to(device)
    for gated in (False, True):
        ref = linear_int_ref(x, **args, gated=gated)
        for config in GEMM_CONFIGS:
            torch.testing.assert_close(linear_int_triton(x, **args, gated=gated, config=config), ref, atol=1e-4,
                                       rtol=1e-4)


@pytest.mark.parametrize("fmt", GEMM_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_kernel_writes_the_reference_weight(fmt, dtype, device, poisoned_allocations):
    """W written by the dequantizing kernel is dequantize_ref's, exactly; with it cuBLAS computes the reference."""
    from kernels.linear_int import dequantize_ref, dequantize_triton, linear_int_dequantized

    k = in_features_of(fmt)
    layer = packed_layer(fmt, 96, k, device)
    ref = dequantize_ref(**layer, dtype=dtype)
    interpreted_bf16 = dtype == torch.bfloat16 and device.type == "cpu"  # it truncates float32 to bf16 (a GPU rounds)
    for config in (None, dict(BLOCK_N=32, BLOCK_K=32)):
        w = dequantize_triton(**layer, dtype=dtype, config=config)
        if interpreted_bf16:
            torch.testing.assert_close(w, ref, atol=0, rtol=2**-7)
        else:
            assert torch.equal(w, ref)
    if not interpreted_bf16:
        x = torch.randn(33, k, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
        assert torch.equal(linear_int_dequantized(x, **layer, gated=True), linear_int_ref(x, **layer, gated=True))


def test_dequantize_kernel_mins(device, poisoned_allocations):
    from kernels.linear_int import dequantize_ref, dequantize_triton

    layer = q4_1_layer(192, 96, device)
    args = dict(qweight=layer["qweight"], qzeros=None, scales=layer["scales"], g_idx=None, group_size=32,
                packing=offset_binary(4), mins=layer["mins"])
    # a GPU may fuse q * scale + min into one FMA (one rounding, not two): a float32 ulp apart at most
    torch.testing.assert_close(dequantize_triton(**args, dtype=torch.float32),
                               dequantize_ref(**args, dtype=torch.float32), atol=1e-6, rtol=1e-6)


def test_gemm_config_fits_and_fills_the_gpu():
    """gemm_config: the smallest row tile holding the rows (128 beyond), tiles for every SM where there are enough
    columns, stages that fit the 227 KiB an H200 program may use."""
    from kernels.linear_int import GEMM_ROW_TILES, gemm_config

    cpu = torch.device("cpu")  # the H200's figures stand in (kernels/_triton.py)
    for rows, block_m in [(17, 32), (64, 64), (65, 128), (2048, 128)]:
        assert gemm_config(rows, 4096, False, torch.bfloat16, cpu)["BLOCK_M"] == block_m
    assert GEMM_ROW_TILES[-1] == 128
    for rows in (32, 256, 2048):
        for n, gated in [(6144, False), (4096, False), (14336, True), (28672, True)]:
            c = gemm_config(rows, n, gated, torch.bfloat16, cpu)
            programs = -(-rows // c["BLOCK_M"]) * -(-n // c["BLOCK_N"])
            assert programs >= 132 or c["BLOCK_N"] == 32, (rows, n, c)
            halves = 2 if gated else 1
            smem = c["num_stages"] * (2 * c["BLOCK_M"] + halves * c["BLOCK_N"]) * c["BLOCK_K"]
            assert smem + halves * 2 * c["BLOCK_K"] * c["BLOCK_N"] <= 227 * 1024, (rows, n, c)


def test_dispatch_threshold_is_an_argument():
    """Off the GPU every size takes the reference, whatever the threshold (the GPU dispatch is in the docstring)."""
    layer = packed_layer(ic.Int4Format("gptq", 32), 32, 64, "cpu")
    x = torch.randn(40, 64)
    for threshold in (1, 10_000):
        assert torch.equal(linear_int(x, **layer, dequantize_min_rows=threshold), linear_int_ref(x, **layer))


@pytest.mark.slow  # the benchmark at toy sizes under the interpreter: make test-slow and CI run it
def test_int4_benchmark_cases_run_under_the_interpreter(device, monkeypatch):
    """benchmarks/kernels_int.py at toy sizes (its GPU run is the lead's): every path builds, matches the reference
    under --check and is timed (once here), with both rates in its rows and the crossing printed. (On a GPU the
    benchmark reads rotating cold copies of each weight, so its byte counts differ: there it is the benchmark.)"""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the benchmark's interpreter run; on a GPU, python -m benchmarks.kernels --only int4")
    import benchmarks.kernels as bench
    from benchmarks import kernels_int

    monkeypatch.setattr(bench, "time_ms", lambda fn, device: (fn(), 1.0)[1])
    runner = bench.Runner(device, check=True, use_triton=True)
    kernels_int.bench_int4(runner, kernels_int.SMOKE_INT_MODELS, ["awq", "gptq", "gptq-act", "gguf-q4_k"],
                           rows_list=[2, 20])
    assert not runner.failures, runner.failures
    impls = {(r["kernel"], r["case"], r["impl"]) for r in runner.results}
    # GPTQ without act-order as a served layer holds it: along N (its checkpoint's layout: "gptq-k")
    assert not kernels_int.packed_layer(128, 128, "gptq", device)["packing"].is_packed_along_k
    assert kernels_int.packed_layer(128, 128, "gptq-k", device)["packing"].is_packed_along_k
    assert ("int4 gptq toy qkv", "rows 2", "stream") in impls
    assert {("int4 awq toy gate_up", "rows 2", impl) for impl in ("stream", "decode tiles", "decode tiles, once")
            } <= impls
    assert not {r for r in impls if r[2] == "stream" and "gptq-act" in r[0]}  # act-order: never streamed
    assert ("int4 awq toy o", "rows 20", "stream") in impls  # past MAX_ROWS: row tiles
    # past MAX_ROWS the GEMM tiles' pairs path beside their float path, for AWQ and GPTQ as held; not act-order
    assert {("int4 awq toy qkv", "rows 20", "gemm tiles, pairs"), ("int4 gptq toy down", "rows 20",
                                                                   "gemm tiles, pairs")} <= impls
    assert not {r for r in impls if r[2] == "gemm tiles, pairs" and ("gptq-act" in r[0] or "gguf" in r[0])}
    assert ("int4 awq toy qkv", "rows 20", "gemm tiles, pairs, 2 stages") in impls  # not gated only
    assert not {r for r in impls if r[2] == "gemm tiles, pairs, 2 stages" and "gate_up" in r[0]}
    # GGUF's groups of 32 (float32 scales and mins): several a K tile of the stream kernel
    assert ("int4 gguf-q4_k toy down", "rows 2", "stream") in impls
    assert {("int4 gptq-act toy down", "rows 20", impl) for impl in ("bf16 cuBLAS", "decode tiles", "gemm tiles",
                                                                     "dequant+cuBLAS")} <= impls
    bf16, gemm = (next(r for r in runner.results if r["kernel"] == "int4 awq toy o" and r["case"] == "rows 20"
                       and r["impl"] == impl) for impl in ("bf16 cuBLAS", "gemm tiles"))
    assert bf16["bytes"] == 128 * 128 * 2 and gemm["bytes"] == 128 * 128 // 2 + 128 * 2 + 128 // 2
    assert gemm["tflop_per_s"] == 2 * 20 * 128 * 128 / 1e-3 / 1e12


def gguf_layer(qtype: str, out_features: int, in_features: int, device) -> dict:
    """A GGUF type's int layer (checkpoints/gguf_types.py) from random blocks, decoded as checkpoints/gguf_blocks.py
    decodes a file's: 8-bit fields for 5- and 6-bit values, groups of 16 (Q6_K), float32 scales and mins
    (k-quants)."""
    from checkpoints.gguf_blocks import decode_blocks, pack_along_k
    from checkpoints.gguf_types import INT_LAYOUTS
    from tests.engine.test_gguf_int import _random_blocks

    layout = INT_LAYOUTS[qtype]
    block = 256 if qtype.endswith("_K") else 32
    q, scales, mins = decode_blocks(qtype, _random_blocks(qtype, out_features, in_features // block, seed=4))
    p = 32 // layout.bits
    zeros = None
    if not layout.has_mins:
        zeros = torch.full((scales.shape[1], out_features // p), 0x80808080 - (1 << 32) if layout.bits == 8
                           else -2004318072, dtype=torch.int32).to(device)
    return dict(qweight=pack_along_k(q, layout.bits).t().contiguous().to(device), qzeros=zeros,
                scales=torch.from_numpy(scales).t().contiguous().to(device), g_idx=None,
                group_size=layout.group_size, packing=offset_binary(layout.bits),
                mins=None if mins is None else torch.from_numpy(mins).t().contiguous().to(device))


GGUF_TYPES = ["Q6_K", "Q4_K", "Q5_K", "Q5_1", "Q5_0"]


# Each type at both sizes, gated on one of them in turn (each size gated and not, in 10 cases rather than 20).
GGUF_CASES = [pytest.param(qtype, rows, (i + j) % 2 == 1, marks=[pytest.mark.slow] if rows > 16 else [])
              for i, qtype in enumerate(GGUF_TYPES) for j, rows in enumerate((3, 40))]  # 40 rows (the GEMM): CI


@pytest.mark.parametrize("qtype,rows,gated", GGUF_CASES, ids=str)
def test_triton_gguf_layouts_match_ref(qtype, rows, gated, device, poisoned_allocations):
    """Q6_K's groups of 16 (at BLOCK_K 16 one group a tile, else gathered), float32 scales and mins, 8-bit fields
    with mins, in the decode tiles (3 rows) and the GEMM tiles (40): the kernel's result is the reference's (to
    float32 summation order: random blocks give weights up to ~30, outputs in the thousands)."""
    layer = gguf_layer(qtype, 96, 512, device)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(5)).to(device)
    ref = linear_int_ref(x, **layer, gated=gated)
    configs = (CONFIGS + [dict(BLOCK_N=32, BLOCK_K=16)] if rows <= 16
               else GEMM_CONFIGS + [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=1)])
    for config in configs:
        torch.testing.assert_close(linear_int_triton(x, **layer, gated=gated, config=config), ref,
                                   atol=1e-6 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_dequantize_kernel_gguf_layouts_exactly(qtype, device, poisoned_allocations):
    """The dequantizing kernel writes the reference's W bit for bit for GGUF layouts, mins included: their integer
    times scale is exact in float32, so a GPU's fused multiply-add rounds as the reference's two operations do."""
    from kernels.linear_int import dequantize_ref, dequantize_triton

    layer = gguf_layer(qtype, 96, 512, device)
    for dtype in (torch.float32, torch.float16):
        ref = dequantize_ref(**layer, dtype=dtype)
        bits = torch.int16 if dtype == torch.float16 else torch.int32  # equal bits: -0.0 is not 0.0
        for config in (None, dict(BLOCK_N=32, BLOCK_K=16)):
            assert torch.equal(dequantize_triton(**layer, dtype=dtype, config=config).view(bits), ref.view(bits))


# The streaming decode kernel (kernels/int_decode.py): layouts whose K tiles lie in one group. Its W is exact, not
# rounded to x's dtype first as dequantize_ref rounds it: float32 x matches to float32 rounding, 16-bit x to the
# rounding of W and of the output (one unit in the last place of each, accumulated over K).
STREAM_FORMATS = [ic.Int4Format("awq", 32), ic.Int4Format("awq", 128), ic.Int4Format("gptq", 128, sym=True),
                  ic.Int4Format("gptq", -1), ic.Int4Format("gptq", 64, bits=8),
                  ic.Int4Format("pack-quantized", 128), ic.Int4Format("pack-quantized", 64, bits=8)]


STREAM_SHAPES = [(1, False, False, 1), (5, True, False, 2), (16, False, True, 4)]  # rows, gated, bias, split
STREAM_DTYPES = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]  # x's dtype, biased
# Each format with each dtype / unpacking, the shape turning with both (a Latin square: each shape meets each
# dtype / unpacking about as often), 21 cases rather than all 63 (each is a second or two under the interpreter).
STREAM_CASES = [(fmt, *STREAM_SHAPES[(i + j) % 3], *dtype_biased)
                for i, fmt in enumerate(STREAM_FORMATS) for j, dtype_biased in enumerate(STREAM_DTYPES)]


@pytest.mark.parametrize("fmt, rows, gated, bias, split, dtype, biased", STREAM_CASES,
                         ids=lambda v: getattr(v, "name", str(v)))
def test_stream_kernel_matches_ref(fmt, rows, gated, bias, split, dtype, biased, device, poisoned_allocations):
    """float32 x: the exact-weight product to float32 rounding. bf16 x, by either unpacking of 4-bit fields (biased:
    B + q in 16-bit pairs, B + z subtracted): within two bf16 units of the output's scale of the float32 product
    (four when gated)."""
    from kernels.int_decode import can_pair_unpack

    if biased and not can_pair_unpack(ic_packing(fmt), dtype, False):
        pytest.skip("8-bit fields take the q - z path only")
    from kernels._triton import dot_precision, upcast_dot_operands
    from kernels.int_decode import can_stream, linear_int_stream

    k = 512 if fmt.group_size in (128, -1) else 256  # 2-4 K tiles a slice; whole groups
    layer = packed_layer(fmt, 96, k, device)  # 96 columns: a partial column tile; gated, 48 a half
    group = layer["group_size"] or k
    assert can_stream(layer["packing"], layer["g_idx"], group, k, 48 if gated else 96, rows, 16)
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(rows, k, generator=gen)).to(dtype).to(device)
    b = torch.randn(96, generator=gen).to(dtype).to(device) if bias else None
    ref = linear_int_ref(x.float(), **layer, bias=None if b is None else b.float(), gated=gated)
    out = linear_int_stream(x, layer["qweight"], layer["qzeros"], layer["scales"], group, layer["packing"], b, gated,
                            False, upcast_dot_operands(dtype, x.device), dot_precision(dtype),
                            config={"SPLIT_K": split, "BIASED": biased})
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:  # gated: silu(gate) * up adds the two products' errors
        assert (out.float() - ref).abs().max() <= (4 if gated else 2) * 2.0 ** -8 * ref.abs().max()
    if biased:
        return
    assert torch.equal(linear_int_triton(x, **layer, bias=b, gated=gated),  # the launcher's choice for these rows
                       linear_int_stream(x, layer["qweight"], layer["qzeros"], layer["scales"], group,
                                         layer["packing"], b, gated, False, upcast_dot_operands(dtype, x.device),
                                         dot_precision(dtype)))


@pytest.mark.parametrize("fmt, k", [(ic.Int4Format("awq", 96), 288), (ic.Int4Format("gptq", 192, bits=8), 384),
                                    (ic.Int4Format("awq", -1), 480)], ids=str)
def test_stream_kernel_groups_of_no_power_of_two(fmt, k, device, poisoned_allocations):
    """Groups of 96 or 192 (and one group of 480): K tiles of the largest power of two dividing the group, so
    every K tile lies in one group and K is whole tiles."""
    from kernels.int_decode import can_stream, stream_config

    layer = packed_layer(fmt, 64, k, device)
    group = layer["group_size"] or k
    assert can_stream(layer["packing"], None, group, k, 64, 2, 16)
    for itemsize in (2, 4):
        cfg = stream_config(2, 64, k, group, fmt.method == "gptq", False, itemsize, device,
                            layer["packing"].pack_factor)
        assert group % cfg["BLOCK_K"] == 0
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5)).to(device)
    torch.testing.assert_close(linear_int_triton(x, **layer), linear_int_ref(x, **layer), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [ic.Int4Format("awq", 128), ic.Int4Format("gptq", 128)], ids=lambda f: f.name)
def test_stream_kernel_half_precision(fmt, dtype, device, poisoned_allocations):
    """16-bit x, by either unpacking (the q - z path, B + q in 16-bit pairs): within the rounding of W and of the
    output (the kernel's W is exact, the reference's rounded)."""
    from kernels._triton import upcast_dot_operands
    from kernels.int_decode import linear_int_stream

    layer = packed_layer(fmt, 256, 512, device)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    exact = linear_int_ref(x.float(), **layer)  # float32 x and W: the exact-weight product, rounded once at the end
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    for biased in (False, True):
        out = linear_int_stream(x, layer["qweight"], layer["qzeros"], layer["scales"], 128, layer["packing"], None,
                                False, False, upcast_dot_operands(dtype, x.device), "tf32",
                                config={"BIASED": biased}).float()
        assert (out - exact).abs().max() <= 2 * ulp * exact.abs().max(), biased


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_kernel_mins(rows, dtype, device, poisoned_allocations):
    """Mins at groups of 128: one group a K tile, a K tile's sum scaled and min * sum(x) added (groups of 32:
    `test_stream_kernel_row_scales`)."""
    from kernels.int_decode import can_stream

    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (512, 96), generator=gen, dtype=torch.int32)
    scales = (torch.rand(4, 96, generator=gen) / 8).half()
    mins = (-torch.rand(4, 96, generator=gen)).half()
    args = dict(qweight=ic._packed(q.numpy(), 0, 4, range(8)).to(device), qzeros=None, scales=scales.to(device),
                g_idx=None, group_size=128, packing=offset_binary(4), mins=mins.to(device))
    assert can_stream(offset_binary(4), None, 128, 512, 96, rows, 16)
    x = torch.randn(rows, 512, generator=gen).to(dtype).to(device)
    for gated in (False, True):
        out, ref = linear_int_triton(x, **args, gated=gated), linear_int_ref(x.float(), **args, gated=gated)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        else:  # B + q dotted, B s - m times sum(x) taken off: within bf16 units of the float32 product
            assert (out.float() - ref).abs().max() <= (4 if gated else 2) * 2.0 ** -8 * ref.abs().max()


# Groups smaller than the K tile (ROW_SCALES): each GGUF type served (4 and 8 bits, zero points or mins, fp16 or float32
# scales, Q6_K's 16), and GPTQ's groups of 32 with zero points; each case gated or not, split or not, 1 or 5 rows.
ROW_SCALE_CASES = [(name, rows, gated, split) for i, name in enumerate(["Q4_0", "Q4_1", "Q8_0", "Q5_K", "Q6_K",
                                                                        "gptq g32"])
                   for rows, gated, split in [((1, 5)[i % 2], i % 3 == 0, (1, 2)[i % 2 == 0])]]


@pytest.mark.parametrize("name, rows, gated, split", ROW_SCALE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_kernel_row_scales(name, rows, gated, split, dtype, spies, device, poisoned_allocations):
    """Groups of 32 and 16 packed along K stream: a K tile of 16 words or more holds several groups, so each word
    row's scales (and zero points, or mins) dequantize W before the dots, as the reference does; float32 x to
    float32 rounding, bf16 x within bf16 units of the float32 product (W rounded to bf16, as the reference's)."""
    from kernels._triton import dot_precision, upcast_dot_operands
    from kernels.int_decode import can_stream, linear_int_stream, stream_config

    k = 512
    layer = (packed_layer(ic.Int4Format("gptq", 32), 96, k, device) if name == "gptq g32"
             else gguf_layer(name, 96, k, device))
    packing, group = layer["packing"], layer["group_size"]
    assert group < 16 * packing.pack_factor and can_stream(packing, None, group, k, 48 if gated else 96, rows, 16)
    cfg = stream_config(rows, 48 if gated else 96, k, group, True, gated, dtype.itemsize, torch.device(device),
                        packing.pack_factor)
    assert cfg["BLOCK_K"] % group == 0 and cfg["BLOCK_K"] > group and cfg["BLOCK_K"] >= 16 * packing.pack_factor
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    ref = linear_int_ref(x.float(), **layer, gated=gated)
    out = linear_int_stream(x, layer["qweight"], layer["qzeros"] if layer.get("mins") is None else layer["mins"],
                            layer["scales"], group, packing, None, gated, layer.get("mins") is not None,
                            upcast_dot_operands(dtype, x.device), dot_precision(dtype), config={"SPLIT_K": split})
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)
    else:
        assert (out.float() - ref).abs().max() <= (4 if gated else 2) * 2.0 ** -8 * ref.abs().max()
    # the launcher's choice for these rows: this kernel (its own split of K)
    torch.testing.assert_close(linear_int_triton(x, **layer, gated=gated), out, atol=1e-3, rtol=1e-3)
    assert spies["_int_decode_kernel"].launches == 2 and spies["_int_dequantize_kernel"].launches == 0


@pytest.mark.parametrize("fmt, gated, biased", [(ic.Int4Format("awq", 128), True, True),
                                                 (ic.Int4Format("awq", 64), False, False),
                                                 (ic.Int4Format("gptq", 128), True, False),
                                                 ("Q4_1", False, False)], ids=str)
def test_stream_kernel_row_tiles(fmt, gated, biased, device, poisoned_allocations):
    """Past a row tile (40 rows in tiles of 16: the last one partial) each program takes one column tile's rows of
    one row tile and a slice of K (each (column tile, row tile) counted apart, its slices summed by its last
    program): equal to one-tile launches row for row, and within bf16 units of the float32 product
    (test_stream_kernel_matches_ref bounds the arithmetic itself)."""
    from kernels._triton import dot_precision, upcast_dot_operands
    from kernels.int_decode import linear_int_stream

    k, rows = 256, 40
    layer = gguf_layer(fmt, 96, k, device) if fmt == "Q4_1" else packed_layer(fmt, 96, k, device)
    mins = layer.get("mins")
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(rows, k, generator=gen)).to(torch.bfloat16).to(device)

    def stream(x, split):
        return linear_int_stream(x, layer["qweight"], layer["qzeros"] if mins is None else mins, layer["scales"],
                                 layer["group_size"], layer["packing"], None, gated, mins is not None,
                                 upcast_dot_operands(x.dtype, x.device), dot_precision(x.dtype),
                                 config={"BLOCK_M": 16, "SPLIT_K": split} | ({} if mins is not None
                                                                              else {"BIASED": biased}))

    out = stream(x, 2)
    ref = linear_int_ref(x.float(), **layer, gated=gated)  # gated: gate, silu, up and their product rounded
    assert (out.float() - ref).abs().max() <= (6 if gated else 2) * 2.0 ** -8 * ref.abs().max()
    for first in (0, 16, 32):  # each row tile as a one-tile launch computes it
        assert torch.equal(out[first:first + 16], stream(x[first:first + 16].contiguous(), 2))
    assert torch.equal(stream(x, 1)[:16], stream(x[:16].contiguous(), 1))  # K unsplit alike


def test_stream_config_row_tiles():
    """Past 16 rows: row tiles of ROW_TILE (16) rows, or of a benchmark's row_tile (the next power of two up to
    it; 8 warps from 64 rows, eight [64, 32] float32 accumulators), K split over all the tiles, stages within
    shared memory."""
    from kernels._triton import shared_memory_per_block
    from kernels.int_decode import ROW_TILE, stream_config

    cpu = torch.device("cpu")
    assert ROW_TILE == 16 and stream_config(40, 4096, 4096, 128, False, True, 2, cpu, 8)["BLOCK_M"] == 16
    for rows, block_m in [(17, 32), (32, 32), (33, 64), (64, 64), (256, 64)]:
        c = stream_config(rows, 4096, 4096, 128, False, True, 2, cpu, 8, row_tile=64)
        assert c["BLOCK_M"] == block_m and c["num_warps"] == (8 if block_m >= 64 else 4)
        assert c["num_stages"] * c["BLOCK_K"] * (block_m * 2 + c["BLOCK_N"]) <= shared_memory_per_block(cpu) // 2
    # 8B's o (16 column tiles) at 64 rows: 4 row tiles, K in 4 slices (about two programs an SM of the H200's 132);
    # at 256 rows 256 tiles, unsplit
    assert stream_config(64, 4096, 4096, 128, False, False, 2, cpu, 8)["SPLIT_K"] == 4
    assert stream_config(256, 4096, 4096, 128, False, False, 2, cpu, 8)["SPLIT_K"] == 1


def test_stream_config_splits_k_to_about_two_programs_an_sm_and_fits():
    """On the H200's 132 SMs (Llama-3-8B's and 70B's layers): split-K to about two programs an SM (at most
    MAX_SPLIT_K slices, each of >= 2 K tiles), no empty slice, and stages that fit shared memory with room to spare.
    The splits the H200 measured best (h200-kernels-tune-int4-splits.json) are the ones named."""
    from kernels.int_decode import MAX_SPLIT_K, stream_config

    cpu = torch.device("cpu")
    measured_best = {(6144, 4096, False): 11, (4096, 4096, False): 16, (14336, 4096, True): 4,
                     (4096, 14336, False): 16, (10240, 8192, False): 6, (8192, 8192, False): 8,
                     (28672, 8192, True): 2, (8192, 28672, False): 8}
    for (n, k, gated), best in measured_best.items():
        for along_k in (False, True):
            c = stream_config(1, n, k, 128, along_k, gated, 2, cpu, 8)
            tiles, k_tiles, split = -(-n // c["BLOCK_N"]), k // c["BLOCK_K"], c["SPLIT_K"]
            per_slice = -(-k_tiles // split)
            assert 1 <= split <= MAX_SPLIT_K and per_slice >= 2 and (split - 1) * per_slice < k_tiles, (n, k, c)
            assert tiles * split <= 2 * 132 or split == 1, (n, k, c)
            assert tiles * split > 132 or split == min(MAX_SPLIT_K, k_tiles // 2), (n, k, c)
            if not along_k:
                assert split == best, (n, k, c)
            row_bytes = 16 * 2 + c["BLOCK_N"] // 2 * (2 if gated else 1)
            assert c["num_stages"] * c["BLOCK_K"] * row_bytes <= 227 * 1024 // 2


class KernelSpy:
    """Counts the launches of a real Triton kernel (`kernel[grid](...)`) and launches it: which kernel a dispatch
    chose, the result still the kernel's."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def spies(monkeypatch):
    """linear_int as on a GPU (use_triton: the interpreter runs the launchers on CPU tensors), its three kernels
    spied on."""
    import kernels.int_decode as int_decode
    import kernels.linear_int as linear_int_module

    monkeypatch.setattr(linear_int_module, "use_triton", lambda t: True)
    found = {}
    for module, name in [(int_decode, "_int_decode_kernel"), (linear_int_module, "_int_linear_kernel"),
                         (linear_int_module, "_int_dequantize_kernel")]:
        found[name] = KernelSpy(getattr(module, name))
        monkeypatch.setattr(module, name, found[name])
    return found


ACT_ORDER, GPTQ_G32 = ic.Int4Format("gptq", 128, desc_act=True), ic.Int4Format("gptq", 32)


@pytest.mark.parametrize("fmt, rows, threshold, kernel", [
    (ic.Int4Format("awq", 128), 1, None, "_int_decode_kernel"), (ic.Int4Format("awq", 128), 16, None,
                                                                 "_int_decode_kernel"),
    (ic.Int4Format("gptq", 128, sym=True), 16, None, "_int_decode_kernel"),
    (ic.Int4Format("awq", 128), 40, None, "_int_decode_kernel"),  # past MAX_ROWS: row tiles of 16
    (ic.Int4Format("awq", 128), 64, None, "_int_decode_kernel"),
    (ic.Int4Format("awq", 128), 65, None, "_int_dequantize_kernel"),  # past STREAM_MAX_ROWS
    (ACT_ORDER, 1, None, "_int_dequantize_kernel"),  # act-order: not streamed
    # groups under the stream's K tile (ROW_SCALES): with mins streamed; with zero points dequantized (an H100
    # measured their stream no faster: kernels/linear_int.py)
    ("Q4_1", 1, None, "_int_decode_kernel"), (GPTQ_G32, 1, None, "_int_dequantize_kernel"),
    ("Q4_0", 1, None, "_int_dequantize_kernel"),
    # a caller's threshold of 20 (70 past the stream's 64 rows): the Triton kernel's tiles below it for what does
    # not stream
    (ic.Int4Format("awq", 128), 65, 70, "_int_linear_kernel"), (ACT_ORDER, 1, 20, "_int_linear_kernel"),
    (GPTQ_G32, 65, 70, "_int_linear_kernel"), (ic.Int4Format("awq", 128), 70, 70, "_int_dequantize_kernel"),
    (ic.Int4Format("awq", 128), 1, 20, "_int_decode_kernel")], ids=str)
def test_dispatch_streams_decode_rows(fmt, rows, threshold, kernel, spies, device):
    """linear_int's choice on a GPU: the streaming kernel for up to STREAM_MAX_ROWS (64) rows (past 16 in row
    tiles) of a layout it takes (no g_idx; K tiles inside a group, or along K whole groups a tile, with mins);
    otherwise dequantize + cuBLAS from dequantize_min_rows (by default from the first row), the first kernel's
    decode tiles or GEMM tiles below it; each equal to the reference."""
    layer = gguf_layer(fmt, 96, 256, device) if isinstance(fmt, str) else packed_layer(fmt, 96, 256, device)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3)).to(device)
    out = linear_int(x, **layer, **({} if threshold is None else {"dequantize_min_rows": threshold}))
    assert {name: spy.launches for name, spy in spies.items()} == {
        name: int(name == kernel) for name in spies}
    torch.testing.assert_close(out, linear_int_ref(x, **layer), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows, dtype, kernel", [
    (70, torch.bfloat16, "_int_linear_kernel"), (81, torch.bfloat16, "_int_dequantize_kernel"),
    (70, torch.float32, "_int_dequantize_kernel"), (64, torch.bfloat16, "_int_decode_kernel")], ids=str)
def test_dispatch_takes_the_pair_tiles_up_to_their_rows(rows, dtype, kernel, spies, device, monkeypatch):
    """With PAIR_GEMM_MAX_ROWS set (80 here; 128 by default), an AWQ layer with 16-bit x past the stream's 64
    rows and up to it runs the PAIRS GEMM tiles (`pair_tiles`); past it, or with float32 x, dequantize + cuBLAS;
    up to 64 rows the stream. Each within the output's rounding of the exact-weight product."""
    import kernels.linear_int as linear_int_module

    monkeypatch.setattr(linear_int_module, "PAIR_GEMM_MAX_ROWS", 80)
    layer = packed_layer(ic.Int4Format("awq", 128), 128, 256, device)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    out = linear_int(x, **layer)
    assert {name: spy.launches for name, spy in spies.items()} == {name: int(name == kernel) for name in spies}
    exact = linear_int_ref(x.float(), **layer)
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert (out.float() - exact).abs().max() <= 2 * ulp * exact.abs().max()


def test_stream_kernel_reuses_its_split_counts(spies, device):
    """Split-K's per-tile counts are reset by each tile's last program: a second launch (as a CUDA graph replays
    the first) adds its slices up again, with new x."""
    from kernels.int_decode import linear_int_stream

    layer = packed_layer(ic.Int4Format("awq", 32), 96, 256, device)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(3, 256, generator=gen).to(device)
        out = linear_int_stream(x, layer["qweight"], layer["qzeros"], layer["scales"], 32, layer["packing"], None,
                                False, False, False, "ieee", config={"SPLIT_K": 4})
        torch.testing.assert_close(out, linear_int_ref(x, **layer), atol=1e-4, rtol=1e-4)
    assert spies["_int_decode_kernel"].launches == 3


# GPU: Llama-3-8B's and 70B's linears drawn packed (benchmarks/kernels_int.py), bf16 x, as the engine calls them.
@functools.lru_cache(maxsize=2)  # a model's four layers in one layout, drawn once for its cases
def _gpu_layers(model: str, layout: str) -> dict:
    """op -> (linear_int's keyword arguments, in_features, gated)."""
    from benchmarks import kernels_int

    torch.manual_seed(0)
    return {op: (kernels_int.packed_layer(n, k, layout, "cuda"), k, gated)
            for op, (n, k, gated) in kernels_int.linears(kernels_int.INT_MODELS[model]).items()}


def _within_bf16_rounding(out, ref, what):
    """The stream kernel's W is exact, the reference's rounded to bf16 before its product: a bf16 unit or two of
    the output's scale."""
    error, scale = (out.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
    assert error <= 2e-2 * scale, (what, error, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("model, layout", [(m, lay) for m in ("8b", "70b")
                                           for lay in ("awq", "gptq", "gptq-k", "gptq-act")])
def test_gpu_decode_rows_real_layers(model, layout, cuda, spies):
    """qkv, o, gate_up + silu and down of Llama-3-8B / 70B at 1, 7 and 16 rows, and in row tiles at 40 and 64:
    AWQ and GPTQ g128 streamed (GPTQ as served, along N, and as its checkpoint packs it, along K; split-K where the
    tiles are fewer than the SMs), GPTQ act-order with its g_idx dequantized for cuBLAS; against the reference."""
    stream = spies["_int_decode_kernel"]
    for op, (layer, k, gated) in _gpu_layers(model, layout).items():
        for rows in (1, 7, 16, 40, 64):
            x = torch.randn(rows, k, device=cuda).to(torch.bfloat16)
            before = stream.launches
            out = linear_int(x, **layer, gated=gated)
            _within_bf16_rounding(out, linear_int_ref(x, **layer, gated=gated), (op, rows))
            assert stream.launches - before == (layout != "gptq-act"), (op, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["awq", "gptq", "gptq-k"])
def test_gpu_pair_unpacking_real_layers(layout, cuda):
    """The B + q unpacking in 16-bit pairs (inline PTX: a thread's two neighbouring words, their zero points as one
    register of two bf16 values) on Llama-3-8B's layers at 1 and 16 rows: the reference's values, and the q - z
    path's to a few bf16 units (both are exact-weight products)."""
    from kernels.int_decode import linear_int_stream

    for op, (layer, k, gated) in _gpu_layers("8b", layout).items():
        for rows in (1, 16):
            x = torch.randn(rows, k, device=cuda).to(torch.bfloat16)
            outs = [linear_int_stream(x, layer["qweight"], layer["qzeros"], layer["scales"], layer["group_size"],
                                      layer["packing"], None, gated, False, False, "tf32", config={"BIASED": b})
                    for b in (False, True)]
            _within_bf16_rounding(outs[1], linear_int_ref(x, **layer, gated=gated), (op, rows))
            _within_bf16_rounding(outs[1], outs[0], (op, rows, "q - z path"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_gpu_pair_tiles_real_layers(layout, cuda, spies, monkeypatch):
    """The PAIRS GEMM tiles (inline PTX) through linear_int's dispatch with PAIR_GEMM_MAX_ROWS set, on Llama-3-8B's
    AWQ and GPTQ (held along N) layers at 65, 200 and 512 rows: the reference's values within bf16 rounding."""
    import kernels.linear_int as linear_int_module

    monkeypatch.setattr(linear_int_module, "PAIR_GEMM_MAX_ROWS", 512)
    tiles = spies["_int_linear_kernel"]
    for op, (layer, k, gated) in _gpu_layers("8b", layout).items():
        for rows in (65, 200, 512):
            x = torch.randn(rows, k, device=cuda).to(torch.bfloat16)
            before = tiles.launches
            out = linear_int(x, **layer, gated=gated)
            assert tiles.launches - before == 1, (op, rows)
            _within_bf16_rounding(out, linear_int_ref(x, **layer, gated=gated), (op, rows))


def test_pair_unpacking_refuses_what_it_cannot_take(device):
    from kernels.int_decode import linear_int_stream

    layer = packed_layer(ic.Int4Format("gptq", 64, bits=8), 64, 128, device)
    x = torch.randn(2, 128).to(torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="BIASED needs 4-bit fields"):
        linear_int_stream(x, layer["qweight"], layer["qzeros"], layer["scales"], 64, layer["packing"], None, False,
                          False, True, "tf32", config={"BIASED": True})


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_gpu_stream_kernel_in_a_cuda_graph(layout, cuda):
    """A decode step as the engine runs it: captured once (split-K's counts and workspace inside), replayed with
    new x; and float32 x (the GPU oracle tests') on its own tiles."""
    layer, k, _ = _gpu_layers("8b", layout)["down"]
    x = torch.randn(4, k, device=cuda).to(torch.bfloat16)
    linear_int(x, **layer)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_int(x, **layer)
    for _ in range(3):
        x.copy_(torch.randn(4, k, device=cuda))
        graph.replay()
        _within_bf16_rounding(out, linear_int_ref(x, **layer), "graph replay")
    x32 = torch.randn(3, k, device=cuda)
    torch.testing.assert_close(linear_int(x32, **layer), linear_int_ref(x32, **layer), atol=1e-3, rtol=1e-3)
