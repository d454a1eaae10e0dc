"""FP8: the quantization definitions, and every FP8 Triton launcher against its torch reference.

Quantizing is exact in both (power-of-two activation and KV scales, round to nearest even), so the quantize and
KV-write kernels must match their references bit for bit; the linear and attention kernels differ only in the
order of their float32 sums.
"""

import functools

import pytest
import torch

import kernels._triton as triton_module
import kernels.linear_fp8 as linear_fp8_module
from kernels.fp8 import (
    FP8_DTYPE,
    MAX_QUANTIZE_BLOCK,
    QuantizedRows,
    dequantize,
    dequantize_weight,
    pow2_ceil,
    pow2_scale,
    quantize_per_token,
    quantize_per_token_ref,
    quantize_per_token_triton,
    quantize_ref,
    quantize_weight,
    quantize_weight_blocks,
)
from kernels.kv_cache import write_kv_cache_ref, write_kv_cache_triton
from kernels.linear_fp8 import MAX_ROWS, auto_split_k, linear_fp8, linear_fp8_ref, linear_fp8_swap, linear_fp8_triton
from kernels.paged_attention import (
    decode_config,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
    paged_attention_prefill_ref,
    paged_attention_prefill_triton,
)
from kernels.rotary import compute_cos_sin_cache, rotary_embedding_and_write_kv, rotary_embedding_triton


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_pow2_scale_is_the_least_power_of_two_that_fits():
    amax = torch.tensor([448.0, 448.01, 224.0, 1.0, 0.0, 1e-40, 3e38])  # 1e-40: subnormal
    scale = pow2_scale(amax, 8)
    assert scale.tolist()[:4] == [1.0, 2.0, 0.5, 2.0 ** -8]
    assert scale[4] == scale[5] == 2.0 ** -126  # nothing to fit: the smallest scale, zeros stay zeros
    assert torch.all(448 * scale >= amax) and torch.all((448 * scale / 2 < amax)[:4])
    assert torch.log2(scale).frac().eq(0).all()
    assert pow2_ceil(torch.tensor([0.3, 0.25, 3.0])).tolist() == [0.5, 0.25, 4.0]


def test_quantize_ref_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([1.0625, 1.1875, 500.0, -1000.0, 0.001953125 * 1.5, 0.0])
    q = quantize_ref(x, torch.tensor(1.0)).float()
    assert q.tolist() == [1.0, 1.25, 448.0, -448.0, 0.00390625, 0.0]  # ties to even, clamped, subnormal


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 3e3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [300, MAX_QUANTIZE_BLOCK + 700])  # one load a pass; two, the second partial
def test_quantize_per_token_kernel_is_bitwise_the_ref(magnitude, dtype, cols, device):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, cols, generator=gen) * magnitude * torch.rand(9, 1, generator=gen) * 4).to(dtype)
    x[5, -1] = x[5].abs().max() * 2  # a row's largest |x| in the last load
    x[3] = 0.0  # an all-zero row
    q, scale = quantize_per_token_triton(x.to(device))
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert torch.equal(scale.cpu(), scale_ref) and torch.equal(bits(q.cpu()), bits(q_ref))
    err = (dequantize(q_ref, scale_ref[:, None]) - x.float()).abs().amax(-1)
    assert torch.all(err <= 2 ** -4 * x.float().abs().amax(-1))  # half an e4m3 step at the top, at most


def test_weight_quantization_roundtrip():
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 24)[:, None]
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (24,)
    torch.testing.assert_close(q.float().abs().amax(-1), torch.full((24,), 448.0))  # each row uses the range
    # Half a step: 2^-4 of the value, or of e4m3's subnormal step (2^-9 of the scale) below 2^-6 (unseeded, the
    # old bound of 2^-4 alone failed for 11 draws in 300: values in the subnormal range).
    assert ((dequantize_weight(q, scale) - w).abs() <= w.abs() * 2 ** -4 + scale[:, None] * 2 ** -10).all()
    qb, scale_b = quantize_weight_blocks(w, (16, 16))
    assert scale_b.shape == (2, 3)
    assert ((dequantize_weight(qb, scale_b, (16, 16)) - w).abs() <= 0.07 * w.abs().amax()).all()


def make_linear(rows, out_rows, in_features, dtype, device, gated=False, bias=False, block=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight_rows = 2 * out_rows if gated else out_rows
    w = torch.randn(weight_rows, in_features, generator=gen) * in_features ** -0.5
    w_q, w_scale = quantize_weight(w) if block is None else quantize_weight_blocks(w, block)
    x = (3 * torch.randn(rows, in_features, generator=gen)).to(dtype)
    return dict(x=x.to(device), weight=w_q.to(device), weight_scale=w_scale.to(device),
                bias=torch.randn(weight_rows, generator=gen).to(dtype).to(device) if bias else None, gated=gated,
                block_size=block)


TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}
DECODE = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64)
GEMM = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, GROUP_M=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,config", [(1, None), (5, DECODE), (MAX_ROWS + 3, None), (37, GEMM)])
@pytest.mark.parametrize("gated,bias", [(False, False), (True, True)])
def test_linear_kernel_matches_ref(dtype, rows, config, gated, bias, device, poisoned_allocations):
    # 40 outputs and 200 inputs: partial tiles in N and K; 37 rows, GROUP_M 2: partial row tiles and groups.
    inputs = make_linear(rows, 40, 200, dtype, device, gated, bias)
    ref = linear_fp8_ref(**inputs)
    out = linear_fp8_triton(**inputs, config=config)
    assert out.shape == ref.shape == (rows, 40) and out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=TOL[dtype][0] * ref.abs().max().item(), rtol=TOL[dtype][1])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,config", [(3, None), (20, GEMM)])
def test_linear_kernel_block_scales(gated, rows, config, device, poisoned_allocations):
    inputs = make_linear(rows, 48, 96, torch.float32, device, gated, block=(16, 32))
    ref = linear_fp8_ref(**inputs)
    torch.testing.assert_close(linear_fp8_triton(**inputs, config=config), ref, atol=1e-4, rtol=1e-4)


def test_linear_kernel_static_and_prequantized_inputs(device, poisoned_allocations):
    inputs = make_linear(6, 40, 200, torch.float32, device)
    static = torch.tensor([0.25], device=device)
    torch.testing.assert_close(linear_fp8_triton(**inputs, input_scale=static),
                               linear_fp8_ref(**inputs, input_scale=static), atol=1e-4, rtol=1e-4)
    x_q, x_scale = quantize_per_token(inputs["x"])
    out = linear_fp8_triton(**{**inputs, "x": x_q}, x_scale=x_scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), linear_fp8_ref(**inputs), atol=0.02, rtol=0.02)



@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("gated,bias", [(False, False), (True, True)])
def test_swap_kernel_matches_ref(rows, gated, bias, device, poisoned_allocations):
    """The decode-sized swap kernel on e4m3 x: 40 outputs, 200 inputs (partial N and K tiles), small tiles."""
    inputs = make_linear(rows, 40, 200, torch.bfloat16, device, gated, bias)
    x_q, x_scale = quantize_per_token(inputs["x"])
    config = dict(BLOCK_N=16, BLOCK_K=64)
    out = linear_fp8_swap(x_q, x_scale, inputs["weight"], inputs["weight_scale"], inputs["bias"], gated,
                          torch.bfloat16, config)
    ref = linear_fp8_ref(**inputs)
    assert out.shape == ref.shape == (rows, 40) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)
    with pytest.raises(ValueError, match="at most"):
        big = quantize_per_token(make_linear(MAX_ROWS + 1, 40, 200, torch.bfloat16, device)["x"])
        linear_fp8_swap(*big, inputs["weight"], inputs["weight_scale"])


@pytest.mark.parametrize("gated,bias", [(False, False), (True, True)])
def test_swap_kernel_split_k_adds_up_to_the_unsplit_result(gated, bias, device, poisoned_allocations):
    """SPLIT_K slices of K (3 slices of 5 K tiles: the last one short), their partial sums added by each tile's
    last program: the unsplit result (float32 sums in another grouping), twice in a row (the counts reset), and
    "auto" picks a split for a layer of few tiles only."""
    inputs = make_linear(5, 40, 300, torch.bfloat16, device, gated, bias)
    x_q, x_scale = quantize_per_token(inputs["x"])
    args = (x_q, x_scale, inputs["weight"], inputs["weight_scale"], inputs["bias"], gated, torch.bfloat16)
    unsplit = linear_fp8_swap(*args, dict(BLOCK_N=16, BLOCK_K=64))
    for _ in range(2):
        split = linear_fp8_swap(*args, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3))
        torch.testing.assert_close(split, unsplit, atol=1e-2, rtol=1e-2)
        assert (split != unsplit).float().mean() < 0.05
    assert triton_module._SPLIT_COUNTS[(x_q.device, "linear")].eq(0).all()
    assert auto_split_k(64, 14336, 512, 132) == 2 and auto_split_k(64, 4096, 512, 132) == 2
    assert auto_split_k(96, 4096, 512, 132) == auto_split_k(224, 4096, 512, 132) == 1
    assert auto_split_k(8, 1024, 512, 132) == 1  # a slice takes two K tiles at least


@pytest.mark.parametrize("impl", ["fused", "quant", "swap"])
def test_every_decode_implementation_gives_the_refs_result(impl, device, monkeypatch, poisoned_allocations):
    """linear_fp8's decode-sized paths (DECODE_IMPL) in bf16, with a checkpoint's static input scale too: the
    launcher each names runs (under the interpreter on CPU, where linear_fp8 itself would take the reference)."""
    monkeypatch.setattr(linear_fp8_module, "DECODE_IMPL", impl)
    monkeypatch.setattr(linear_fp8_module, "use_triton", lambda tensor: True)
    calls = []
    for name in ("linear_fp8_swap", "linear_fp8_triton"):
        launcher = getattr(linear_fp8_module, name)
        monkeypatch.setattr(linear_fp8_module, name,
                            lambda *a, _f=launcher, _n=name, **k: calls.append((_n, a[0].dtype)) or _f(*a, **k))
    monkeypatch.setattr(linear_fp8_module, "swap_config", lambda gated: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64,
                                                                              num_warps=4, num_stages=2))
    for gated, static in [(False, None), (True, None), (False, torch.tensor([0.25]))]:
        inputs = make_linear(3, 40, 200, torch.bfloat16, device, gated, bias=True)
        if static is not None:
            inputs["input_scale"] = static.to(device)
        out, ref = linear_fp8(**inputs), linear_fp8_ref(**inputs)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)
    expected = {"fused": ("linear_fp8_triton", torch.bfloat16), "quant": ("linear_fp8_triton", FP8_DTYPE),
                "swap": ("linear_fp8_swap", FP8_DTYPE)}[impl]
    assert calls == [expected] * 3

@pytest.mark.parametrize("impl", ["fused", "quant", "swap"])
def test_quantized_rows_give_what_the_layer_quantizing_x_gives(impl, device, monkeypatch, poisoned_allocations):
    """x handed over as QuantizedRows (RMSNorm's fused quantization) gives the result of x quantized in the layer,
    on every decode-sized path and float32's precise one (interpreter), and in the reference exactly."""
    monkeypatch.setattr(linear_fp8_module, "DECODE_IMPL", impl)
    monkeypatch.setattr(linear_fp8_module, "use_triton", lambda tensor: True)
    monkeypatch.setattr(linear_fp8_module, "swap_config", lambda gated: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64,
                                                                              num_warps=4, num_stages=2))
    for dtype, gated in [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)]:
        inputs = make_linear(3, 40, 200, dtype, device, gated, bias=True)
        rows = QuantizedRows(*quantize_per_token_ref(inputs["x"]), dtype)
        out, expected = linear_fp8(**{**inputs, "x": rows}), linear_fp8(**inputs)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(linear_fp8_ref(**{**inputs, "x": rows}), linear_fp8_ref(**inputs))
    blocked = make_linear(3, 128, 128, torch.bfloat16, device, block=(64, 64))
    with pytest.raises(ValueError, match="per-row weight scales"):
        linear_fp8(**{**blocked, "x": QuantizedRows(*quantize_per_token_ref(blocked["x"]), torch.bfloat16)})
    inputs = make_linear(3, 40, 200, torch.bfloat16, device)
    with pytest.raises(ValueError, match="static input_scale"):
        linear_fp8(**{**inputs, "x": QuantizedRows(*quantize_per_token_ref(inputs["x"]), torch.bfloat16)},
                   input_scale=torch.tensor([0.25], device=device))


@pytest.mark.parametrize("impl", ["fused", "quant", "swap"])
def test_gated_layer_quantizes_its_output_for_the_next(impl, device, monkeypatch, poisoned_allocations):
    """quantize_output: the SiLU-and-mul output as QuantizedRows, bit for bit quantize_per_token of the output
    without it, on each decode-sized path (interpreter) and the reference; only a gated layer takes it."""
    monkeypatch.setattr(linear_fp8_module, "DECODE_IMPL", impl)
    monkeypatch.setattr(linear_fp8_module, "use_triton", lambda tensor: True)
    monkeypatch.setattr(linear_fp8_module, "swap_config", lambda gated: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64,
                                                                              num_warps=4, num_stages=2))
    inputs = make_linear(3, 40, 200, torch.bfloat16, device, gated=True, bias=True)
    for uses_triton in (True, False):
        monkeypatch.setattr(linear_fp8_module, "use_triton", lambda tensor, _t=uses_triton: _t)
        out, rows = linear_fp8(**inputs), linear_fp8(**inputs, quantize_output=True)
        values, scale = quantize_per_token_ref(out)
        assert isinstance(rows, QuantizedRows) and rows.dtype == torch.bfloat16
        assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(rows.scale, scale)
    with pytest.raises(ValueError, match="gated"):
        linear_fp8(**{**inputs, "gated": False}, quantize_output=True)


def test_scaled_mm_path_takes_and_gives_quantized_rows(device, monkeypatch, poisoned_allocations):
    """From 17 rows (torch._scaled_mm, which runs on CPU too): QuantizedRows in give what x in gives, and a gated
    layer's quantize_output (SiLU-and-mul's fused kernel, interpreted) is quantize_per_token of its output."""
    import kernels.activation as activation

    monkeypatch.setattr(linear_fp8_module, "use_triton", lambda tensor: True)
    monkeypatch.setattr(activation, "use_triton", lambda tensor: True)
    inputs = make_linear(MAX_ROWS + 4, 48, 64, torch.bfloat16, device, gated=True, bias=True)
    rows = QuantizedRows(*quantize_per_token_ref(inputs["x"]), torch.bfloat16)
    out = linear_fp8(**inputs)
    assert torch.equal(linear_fp8(**{**inputs, "x": rows}), out)
    ref = linear_fp8_ref(**inputs)
    torch.testing.assert_close(out, ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)
    quantized = linear_fp8(**inputs, quantize_output=True)
    values, scale = quantize_per_token_ref(out)
    assert torch.equal(quantized.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(quantized.scale, scale)


def test_linear_ref_is_the_dequantized_matmul():
    """The definition the transformers oracle copies: per-token fake-quantized x times the dequantized weight."""
    inputs = make_linear(4, 16, 32, torch.float32, "cpu", bias=True)
    x_q, x_scale = quantize_per_token_ref(inputs["x"])
    expected = torch.nn.functional.linear(dequantize(x_q, x_scale[:, None]),
                                          dequantize_weight(inputs["weight"], inputs["weight_scale"]), inputs["bias"])
    assert torch.equal(linear_fp8_ref(**inputs), expected)
    assert torch.equal(linear_fp8(**inputs), expected)  # on CPU the public function is the reference
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        linear_fp8_ref(**{**inputs, "weight_scale": inputs["weight_scale"][:3]})
    with pytest.raises(ValueError, match="weight must have dtype"):
        linear_fp8_ref(**{**inputs, "weight": inputs["weight"].float()})


def kv_case(num_tokens, num_kv_heads, head_dim, block_size, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 5
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    num_blocks = -(-2 * num_tokens // block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[:2] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_scale = torch.tensor([2.0 ** -4, 2.0 ** -2, 1.0][:num_kv_heads])
    v_scale = torch.tensor([2.0 ** -6, 2.0 ** -5, 2.0][:num_kv_heads])
    caches = [torch.full(shape, float("nan")).to(FP8_DTYPE) for _ in "kv"]  # NaN bytes wherever nothing is written
    return [t.to(device) for t in (k, v, *caches, slots, k_scale, v_scale)]


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 32, 4), (3, 16, 16)])
def test_fp8_kv_write_is_bitwise_the_ref(num_kv_heads, head_dim, block_size, device):
    k, v, k_cache, v_cache, slots, k_scale, v_scale = kv_case(21, num_kv_heads, head_dim, block_size, device)
    ref_k, ref_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    write_kv_cache_ref(k.cpu(), v.cpu(), ref_k, ref_v, slots.cpu(), k_scale.cpu(), v_scale.cpu())
    write_kv_cache_triton(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(bits(k_cache.cpu()), bits(ref_k)) and torch.equal(bits(v_cache.cpu()), bits(ref_v))
    written = ref_k[slots[slots >= 0].cpu() // block_size, slots[slots >= 0].cpu() % block_size]
    torch.testing.assert_close(dequantize(written, k_scale.cpu()[:, None]), k[slots >= 0].cpu(), atol=0.02,
                               rtol=2 ** -4)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        write_kv_cache_triton(k, v, k_cache, v_cache, slots)


def test_fused_rotary_fp8_kv_write_is_bitwise_the_ref(device):
    k, v, k_cache, v_cache, slots, k_scale, v_scale = kv_case(13, 2, 32, 4, device)
    q = torch.randn(13, 4, 32, device=device)
    positions = torch.randint(0, 64, (13,), device=device)
    cos_sin = compute_cos_sin_cache(32, 64, 10000.0).to(device)
    ref = [t.cpu().clone() for t in (q, k, v, k_cache, v_cache)]
    rotary_embedding_and_write_kv(positions.cpu(), *ref[:3], cos_sin.cpu(), 32, *ref[3:], slots.cpu(),
                                  k_scale.cpu(), v_scale.cpu())  # CPU tensors: the reference
    rotary_embedding_triton(positions, q, k, cos_sin, 32, (v, k_cache, v_cache, slots, k_scale, v_scale))
    torch.testing.assert_close(q.cpu(), ref[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(bits(k_cache.cpu()), bits(ref[3])) and torch.equal(bits(v_cache.cpu()), bits(ref[4]))


def paged_fp8(seq_lens, num_kv_heads, head_dim, block_size, device, seed=0):
    """Shuffled paged e4m3 K/V (unused blocks hold NaN bytes) and per-head scales."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_scale = 2.0 ** torch.randint(-4, 2, (num_kv_heads,), generator=gen).float()
    v_scale = 2.0 ** torch.randint(-6, 0, (num_kv_heads,), generator=gen).float()
    caches = [quantize_ref(torch.randn(shape, generator=gen) * s[:, None], (1 / s)[:, None]) for s in
              (k_scale * 50, v_scale * 50)]
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(blocks) + 1), int(order[-1]), dtype=torch.int32)
    caches[0][order[-1]] = caches[1][order[-1]] = torch.tensor(float("nan")).to(FP8_DTYPE)
    start = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = order[start:start + nb].int()
        start += nb
    return [t.to(device) for t in (*caches, tables, k_scale, v_scale)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode_matches_ref(dtype, num_splits, device, poisoned_allocations):
    seq_lens = [1, 17, 40]
    k_cache, v_cache, tables, k_scale, v_scale = paged_fp8(seq_lens, 2, 32, 4, device)
    q = torch.randn(3, 8, 32).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.2, k_scale=k_scale, v_scale=v_scale)
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.2, num_splits=num_splits,
                                        k_scale=k_scale, v_scale=v_scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # The reference is attention over the dequantized values.
    dense = paged_attention_decode_ref(q.float(), dequantize(k_cache, k_scale[:, None]),
                                       dequantize(v_cache, v_scale[:, None]), tables, lens, 0.2)
    torch.testing.assert_close(ref.float(), dense, atol=tol, rtol=tol)


@pytest.mark.parametrize("config", [{"f16_dots": False}, {"f16_dots": True}, {"f16_dots": True, "block_n": 128},
                                    {"f16_dots": False, "block_n": 128}],
                         ids=["bf16 dots", "f16 dots", "f16 dots, 128-key tiles", "bf16 dots, 128-key tiles"])
def test_fp8_decode_dot_types_and_wide_tiles_match_ref(config, device, poisoned_allocations):
    # a bf16 query over an e4m3 pool, sequences spanning several 128-key tiles and ending mid-tile
    seq_lens = [3, 130, 300]
    k_cache, v_cache, tables, k_scale, v_scale = paged_fp8(seq_lens, 2, 32, 16, device, seed=3)
    q = torch.randn(3, 8, 32).to(torch.bfloat16).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.2, k_scale=k_scale, v_scale=v_scale)
    for num_splits in (1, 2):
        out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.2, num_splits=num_splits,
                                            config=config, k_scale=k_scale, v_scale=v_scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_fp8_decode_config_takes_float16_dots_and_wide_tiles_where_measured_faster():
    cpu = torch.device("cpu")  # counted as 132 SMs
    config = functools.partial(decode_config, 128, torch.bfloat16, device=cpu)
    assert config(64 * 8, kv_fp8=True) == dict(block_n=128, num_warps=4, num_stages=3, fused_merge=True,
                                               f16_dots=True)
    assert config(256 * 8, kv_fp8=True)["block_n"] == 128 and config(256 * 8, kv_fp8=True)["f16_dots"]
    assert config(1024 * 8, kv_fp8=True)["block_n"] == 128
    assert decode_config(256, torch.bfloat16, 64 * 8, cpu, kv_fp8=True)["block_n"] == 32  # head_dim 256: as bf16's
    assert config(64 * 8, kv_fp8=True, windowed=True)["block_n"] == 32  # no register spill on sm_90
    assert config(8 * 8 * 4, kv_fp8=True)["block_n"] == 64  # few programs: deep pipelines of 64-key tiles
    assert not config(64 * 8)["f16_dots"] and config(64 * 8)["block_n"] == 64  # a bf16 pool: as before


def test_fp8_prefill_matches_ref(device, poisoned_allocations):
    seq_lens, q_lens = [9, 30], [9, 5]  # a whole prompt, and a chunk after cached context
    k_cache, v_cache, tables, k_scale, v_scale = paged_fp8(seq_lens, 2, 32, 4, device, seed=1)
    q = torch.randn(sum(q_lens), 4, 32, device=device)
    starts = torch.tensor([0, 9, 14], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    ref = paged_attention_prefill_ref(q, k_cache, v_cache, tables, starts, lens, 0.2, k_scale=k_scale,
                                      v_scale=v_scale)
    out = paged_attention_prefill_triton(q, k_cache, v_cache, tables, starts, lens, 0.2, k_scale=k_scale,
                                         v_scale=v_scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_prefill_triton(q, k_cache, v_cache, tables, starts, lens, 0.2)



@pytest.mark.parametrize("config", [None, {"block_n": 32}], ids=["default", "32-key tiles"])
def test_fp8_attention_with_a_sliding_window_matches_ref(config, device, poisoned_allocations):
    """A sliding window over an e4m3 pool (Mistral, Qwen3, Phi-3 with kv_cache_dtype="fp8"): both options at once,
    windows starting mid-tile, on a tile and before the first key; decode split and not, and a prefill chunk."""
    seq_lens, window = [1, 17, 40, 70], 9
    k_cache, v_cache, tables, k_scale, v_scale = paged_fp8(seq_lens, 2, 32, 4, device, seed=2)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), 4, 32).to(device)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.2, sliding_window=window, **scales)
    dense = paged_attention_decode_ref(q, dequantize(k_cache, k_scale[:, None]), dequantize(v_cache, v_scale[:, None]),
                                       tables, lens, 0.2, sliding_window=window)
    torch.testing.assert_close(ref, dense, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(ref, paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.2, **scales))
    for num_splits in (1, 3):
        out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.2, num_splits=num_splits,
                                            config=config, sliding_window=window, **scales)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    q_lens = [1, 17, 6, 70]  # a decode row, a whole prompt, a chunk after cached context, a long prompt
    q = torch.randn(sum(q_lens), 4, 32, device=device)
    starts = torch.tensor([0, 1, 18, 24, 94], dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, tables, starts, lens, 0.2)
    ref = paged_attention_prefill_ref(*args, sliding_window=window, **scales)
    out = paged_attention_prefill_triton(*args, max_query_len=70, config=config and {"block_m": 16, **config},
                                         sliding_window=window, **scales)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 17, 256, 2048])
def test_gpu_fp8_llama3_8b_projections(rows, cuda):
    """A Llama-3-8B layer's projections through the public call (decode-sized, GEMM, _scaled_mm) in bf16."""
    for out_rows, in_features, gated in [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
                                         (4096, 14336, False)]:
        inputs = make_linear(rows, out_rows, in_features, torch.bfloat16, cuda, gated)
        out, ref = linear_fp8(**inputs), linear_fp8_ref(**inputs)
        # Hopper's FP8 MMA accumulates in fewer bits than the float32 reference. Ours (the swap kernel, up to
        # MAX_ROWS rows) promotes its sums to float32 every 512 products: 14-16% of the bf16 outputs round otherwise,
        # all within 0.5% of the largest, a mean error of 3-4e-4 of the mean output. cuBLASLt's fast accumulation
        # (FAST_ACCUM, from MAX_ROWS + 1) never does: 27-47%, 1.1-2.4e-3 (K 4,096 / 14,336), within 1.1% of the
        # largest output (H100, 2026-12-06; h100-fp8-fast-accum-gemms.json).
        swap = rows <= MAX_ROWS
        torch.testing.assert_close(out, ref, atol=(1e-2 if swap else 2e-2) * ref.abs().max().item(), rtol=3e-2)
        mean_error = ((out.float() - ref.float()).abs().mean() / ref.float().abs().mean()).item()
        assert mean_error < (1e-3 if swap else 5e-3), mean_error
        if swap:
            assert (out != ref).float().mean() < 0.2


@pytest.mark.gpu
def test_gpu_fp8_kv_write_and_attention(cuda):
    k, v, k_cache, v_cache, slots, k_scale, v_scale = kv_case(4096, 3, 128, 16, cuda)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, ref_k, ref_v, slots, k_scale, v_scale)
    write_kv_cache_triton(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(bits(k_cache), bits(ref_k)) and torch.equal(bits(v_cache), bits(ref_v))
    k_cache, v_cache, tables, k_scale, v_scale = paged_fp8([8192, 300, 1], 8, 128, 16, cuda)
    q = torch.randn(3, 32, 128, device=cuda, dtype=torch.bfloat16)
    lens = torch.tensor([8192, 300, 1], dtype=torch.int32, device=cuda)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.088, k_scale=k_scale, v_scale=v_scale)
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.088, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # a batch of many programs (80 x 8 KV heads, more than two an SM): 128-key tiles, lengths ending mid-tile
    seq_lens = torch.randint(1, 1500, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    k_cache, v_cache, tables, k_scale, v_scale = paged_fp8(seq_lens, 8, 128, 16, cuda, seed=4)
    assert decode_config(128, torch.bfloat16, 80 * 8, cuda, kv_fp8=True)["block_n"] == 128
    q = torch.randn(80, 32, 128, device=cuda, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=cuda)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.088, k_scale=k_scale, v_scale=v_scale)
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, 0.088, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # the benchmark at toy sizes under the interpreter: make test-slow and CI run it
def test_fp8_benchmark_cases_run_under_the_interpreter(device, monkeypatch):
    """benchmarks/kernels_fp8.py at toy sizes (its GPU run is the lead's): every case builds, checks and times."""
    import benchmarks.kernels as bench
    import benchmarks.kernels_fp8 as bench_fp8

    monkeypatch.setattr(bench_fp8, "FP8_ROWS", [2])
    monkeypatch.setattr(bench_fp8, "GEMM_ROWS", [20])
    monkeypatch.setattr(bench_fp8, "KV_CASES", [(2, 40)])
    monkeypatch.setattr(bench, "LINEAR_COPIES", 1)
    monkeypatch.setattr(bench_fp8, "SWAP_CONFIGS", bench_fp8.SWAP_CONFIGS[:1])
    cfg = dict(bench.SMOKE, num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, inter=64, dtype=torch.bfloat16)
    runner = bench.Runner(device, check=True, use_triton=True)
    bench_fp8.bench_fp8(runner, cfg)
    assert not runner.failures, runner.failures
    impls = {(r["kernel"], r["impl"]) for r in runner.results}
    assert {("fp8 linear", name) for name in bench_fp8.decode_impls()} <= impls
    assert ("fp8 gemm", "fp8 quant+scaled_mm") in impls
    assert ("fp8 kv decode", "fp8 triton") in impls
