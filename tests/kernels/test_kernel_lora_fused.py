"""kernels/lora_fused.py: the fused decode kernel (shrink and expand in one launch) against the references, the
expand fused into the SiLU-and-mul against the unfused kernels (bit for bit) and the references, and the two
dispatchers a layer calls, at sizes that cross the row, column, chunk and K tiles."""

import pytest
import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.lora import lora_expand_ref, lora_expand_triton, lora_shrink_ref, lora_shrink_triton
from kernels.lora_fused import (
    FUSED_MAX_TOKENS,
    SILU_MAX_RANK,
    fused_config,
    lora_apply,
    lora_expand_silu_triton,
    lora_fused_triton,
    lora_silu_and_mul,
)
from tests.kernels.test_kernel_lora import (
    DTYPES,
    LAYOUTS,
    LLAMA3_8B,
    SLOT_PATTERNS,
    decode_slots,
    make_case,
    prefill_slots,
    starts_of,
    ulps,
)


def check_fused(out, x, lora_a, lora_b, slots, starts, config=None):
    before, expected = out.clone(), out.clone()
    lora_expand_ref(expected, lora_shrink_ref(x, lora_a, slots), lora_b, slots, starts)
    lora_fused_triton(out, x, lora_a, lora_b, slots, starts, config=config)
    assert torch.equal(out[slots < 0], before[slots < 0])  # rows without an adapter untouched, bit for bit
    # y summed over K in another order than the reference's, then one rounding: within a unit in the last place
    tol = ulps(out.dtype)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def gate_up_reference(out, y, lora_b, slots):
    expected = out.clone()
    lora_expand_ref(expected, y, lora_b, slots, (0, out.shape[1] // 2))
    return silu_and_mul_ref(expected)


def check_expand_silu(out, y, lora_b, slots, config=None):
    before, unfused = out.clone(), out.clone()
    lora_expand_triton(unfused, y, lora_b, slots, (0, out.shape[1] // 2))
    act = lora_expand_silu_triton(out, y, lora_b, slots, config=config)
    assert torch.equal(out, before)  # the layer's output is read, not written
    assert act.shape == (out.shape[0], out.shape[1] // 2) and act.dtype == out.dtype
    # the same float32 sums and roundings as the expand then silu_and_mul, the rank's sums perhaps in another order
    # (other tile shapes): a unit in the last place of gate' or up' at most
    torch.testing.assert_close(act, silu_and_mul_triton(unfused), atol=2 * ulps(out.dtype),
                               rtol=2 * ulps(out.dtype))
    # and the torch reference (torch's silu rounds its own way in 16 bits: a few units in the last place)
    reference = gate_up_reference(before, y, lora_b, slots)
    tol = 4 * ulps(out.dtype)
    torch.testing.assert_close(act, reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 4, 21])  # one 16-row tile, two with a ragged end
def test_fused_matches_shrink_then_expand(num_tokens, pattern, dtype, device):
    widths = LAYOUTS["qkv"]
    slots = SLOT_PATTERNS[pattern](num_tokens, 4)
    x, lora_a, lora_b, _, out, slots = make_case(num_tokens, 72, widths, 16, 4, dtype, slots, device)
    check_fused(out, x, lora_a, lora_b, slots, starts_of(widths))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", [dict(BLOCK_N=16, N_CHUNKS=1, BLOCK_K=16), dict(BLOCK_N=16, N_CHUNKS=3, BLOCK_K=32),
                                    dict(BLOCK_N=32, N_CHUNKS=4, BLOCK_K=64)])
def test_fused_chunks_and_k_tiles(layout, config, device):
    """A program's chunks run past its slice's end (masked), ragged K tiles, and slices off the chunk grid."""
    widths = LAYOUTS[layout]
    x, lora_a, lora_b, _, out, slots = make_case(7, 100, widths, 16, 3, torch.bfloat16, decode_slots(7, 3), device)
    check_fused(out, x, lora_a, lora_b, slots, starts_of(widths), config=config)


@pytest.mark.parametrize("rank", [8, 32, 64])
def test_fused_every_rank(rank, device, poisoned_allocations):
    widths = LAYOUTS["gate_up"]
    x, lora_a, lora_b, _, out, slots = make_case(3, 40, widths, rank, 3, torch.float16, [2, -1, 0], device)
    check_fused(out, x, lora_a, lora_b, slots, starts_of(widths))


def test_fused_strided_views_and_offset_slices(device):
    """x and out as column windows of wider tensors; columns before the first slice untouched."""
    x, lora_a, lora_b, _, out, slots = make_case(3, 40, (10, 0, 30), 16, 2, torch.float16, [1, 0, -1], device)
    wide_x = torch.zeros(3, 47, dtype=x.dtype, device=device)
    wide_x[:, 5:45] = x
    wide_out = torch.zeros(3, 49, dtype=out.dtype, device=device)
    wide_out[:, 3:43] = out
    check_fused(wide_out[:, 3:43], wide_x[:, 5:45], lora_a, lora_b, slots, (6, 10, 10))
    assert torch.equal(wide_out[:, 3:9], out[:, :6]) and not wide_out[:, 43:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 21, 70])
def test_expand_silu_matches_expand_then_silu(num_tokens, pattern, dtype, device):
    slots = SLOT_PATTERNS[pattern](num_tokens, 4)
    _, _, lora_b, y, out, slots = make_case(num_tokens, 24, (40, 40), 16, 4, dtype, slots, device)
    check_expand_silu(out, y, lora_b, slots)
    check_expand_silu(out, y, lora_b, slots, config=dict(BLOCK_M=16, BLOCK_N=16))


@pytest.mark.parametrize("rank", [8, 64])
def test_expand_silu_ranks_and_strided_rows(rank, device, poisoned_allocations):
    _, _, lora_b, y, out, slots = make_case(19, 24, (36, 36), rank, 3, torch.bfloat16, decode_slots(19, 3), device)
    wide = torch.zeros(19, 80, dtype=out.dtype, device=device)
    wide[:, :72] = out
    check_expand_silu(wide[:, :72], y, lora_b, slots)


@pytest.mark.parametrize("num_tokens", [FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 1])
def test_dispatchers_equal_the_references_on_either_side_of_the_threshold(num_tokens, device):
    """lora_apply and lora_silu_and_mul with the kernels (the fused one up to FUSED_MAX_TOKENS, shrink + expand
    past it) and with the references (use_kernel=False, as on CPU)."""
    widths = LAYOUTS["gate_up"]
    slots = decode_slots(num_tokens, 3, seed=num_tokens)
    x, lora_a, lora_b, _, out, slots = make_case(num_tokens, 40, widths, 16, 3, torch.bfloat16, slots, device)
    expected = out.clone()
    lora_expand_ref(expected, lora_shrink_ref(x, lora_a, slots), lora_b, slots, (0, 40))
    got, ref = out.clone(), out.clone()
    lora_apply(got, x, lora_a, lora_b, slots, (0, 40), use_kernel=True)
    lora_apply(ref, x, lora_a, lora_b, slots, (0, 40), use_kernel=False)
    assert torch.equal(ref, expected)
    torch.testing.assert_close(got, expected, atol=ulps(out.dtype), rtol=ulps(out.dtype))
    act = lora_silu_and_mul(out.clone(), x, lora_a, lora_b, slots, use_kernel=True)
    unfused = out.clone()
    lora_expand_triton(unfused, lora_shrink_triton(x, lora_a, slots), lora_b, slots, (0, 40))
    torch.testing.assert_close(act, silu_and_mul_triton(unfused), atol=2 * ulps(out.dtype), rtol=2 * ulps(out.dtype))
    tol = 4 * ulps(out.dtype)
    torch.testing.assert_close(act, silu_and_mul_ref(expected), atol=tol, rtol=tol)
    assert torch.equal(lora_silu_and_mul(out.clone(), x, lora_a, lora_b, slots, use_kernel=False),
                       silu_and_mul_ref(expected))


def test_gate_up_past_silu_max_rank_takes_the_expand_then_silu(device):
    """Rank 80 (128-wide tiles, where the fused activation would spill): lora_apply then silu_and_mul."""
    assert SILU_MAX_RANK < 80
    x, lora_a, lora_b, _, out, slots = make_case(9, 24, (20, 20), 80, 2, torch.float16, decode_slots(9, 2), device)
    expected = out.clone()
    lora_expand_ref(expected, lora_shrink_ref(x, lora_a, slots), lora_b, slots, (0, 20))
    act = lora_silu_and_mul(out, x, lora_a, lora_b, slots, use_kernel=True)
    torch.testing.assert_close(act, silu_and_mul_ref(expected), atol=4 * ulps(out.dtype), rtol=4 * ulps(out.dtype))


def test_fused_config_fills_a_third_of_the_sms():
    cpu = torch.device("cpu")
    assert fused_config(1, 6144, 16, torch.bfloat16, cpu)["BLOCK_M"] == 16
    assert fused_config(1, 64, 16, torch.bfloat16, cpu)["N_CHUNKS"] == 1


def test_bad_inputs_name_the_argument(device):
    x, lora_a, lora_b, y, out, slots = make_case(4, 24, (16, 8), 8, 2, torch.float32, [0, 1, -1, 1], device)
    with pytest.raises(ValueError, match="lora_b"):
        lora_fused_triton(out, x, lora_a, lora_b[:, :20], slots, (0, 16))
    with pytest.raises(ValueError, match="lora_a"):
        lora_fused_triton(out, x, lora_a[..., :20], lora_b, slots, (0, 16))
    with pytest.raises(ValueError, match="slice_starts"):
        lora_fused_triton(out, x, lora_a, lora_b, slots, (0,))
    with pytest.raises(ValueError, match="out must be"):
        lora_expand_silu_triton(out[:, :23], y, lora_b[:, :23], slots)
    with pytest.raises(ValueError, match="y must"):
        lora_expand_silu_triton(out, y[:, :, :4], lora_b, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64])
@pytest.mark.parametrize("layer", LLAMA3_8B)
def test_gpu_fused_llama3_8b_layers(layer, num_tokens, cuda):
    in_features, widths = LLAMA3_8B[layer]
    for rank in (16, 64):
        x, lora_a, lora_b, _, out, slots = make_case(num_tokens, in_features, widths, rank, 8, torch.bfloat16,
                                                     decode_slots(num_tokens, 8), cuda)
        check_fused(out, x, lora_a, lora_b, slots, starts_of(widths))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [64, 2048])
def test_gpu_expand_silu_llama3_8b(num_tokens, cuda):
    slots = (decode_slots(num_tokens, 8) if num_tokens <= 256 else
             prefill_slots([(num_tokens // 8, s - 1) for s in range(8)]))
    _, _, lora_b, y, out, slots = make_case(num_tokens, 16, LLAMA3_8B["gate_up"][1], 16, 8, torch.bfloat16, slots,
                                            cuda)
    check_expand_silu(out, y, lora_b, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_gpu_fused_in_a_cuda_graph(num_tokens, cuda):
    """The fused decode kernel captured once and replayed with other slots and inputs."""
    in_features, widths = LLAMA3_8B["gate_up"]
    x, lora_a, lora_b, _, out, slots = make_case(num_tokens, in_features, widths, 16, 8, torch.bfloat16,
                                                 decode_slots(num_tokens, 8), cuda)
    base = out.clone()

    def step():
        out.copy_(base)
        lora_apply(out, x, lora_a, lora_b, slots, starts_of(widths))

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(1, 4):
        slots.copy_(torch.tensor(decode_slots(num_tokens, 8, seed=seed), dtype=torch.int32))
        x.copy_(torch.randn_like(x))
        graph.replay()
        expected = base.clone()
        lora_expand_ref(expected, lora_shrink_ref(x, lora_a, slots), lora_b, slots, starts_of(widths))
        torch.testing.assert_close(out, expected, atol=ulps(out.dtype), rtol=ulps(out.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["decode", "prefill", "none"])
def test_rows_sorted_by_slot_give_the_same_results(pattern, dtype, device):
    """order = argsort(slots): shrink, expand and expand + SiLU tile the sorted rows (gathered x, y and out rows,
    tiles of one or two slots) and give what they give unsorted; the dispatchers take it through."""
    num_tokens = 37
    slots = SLOT_PATTERNS[pattern](num_tokens, 4)
    x, lora_a, lora_b, y, out, slots = make_case(num_tokens, 40, (24, 24), 16, 4, dtype, slots, device)
    order = torch.argsort(slots.cpu(), stable=True).to(device=device, dtype=torch.int32)
    config = dict(BLOCK_M=16)
    torch.testing.assert_close(lora_shrink_triton(x, lora_a, slots, config=config, order=order),
                               lora_shrink_ref(x, lora_a, slots), atol=1e-5, rtol=1e-4)
    expected, got = out.clone(), out.clone()
    lora_expand_ref(expected, y, lora_b, slots, (0, 24))
    lora_expand_triton(got, y, lora_b, slots, (0, 24), config=dict(BLOCK_M=16, BLOCK_N=16), order=order)
    torch.testing.assert_close(got, expected, atol=ulps(dtype), rtol=ulps(dtype))
    assert torch.equal(got[slots < 0], out[slots < 0])
    torch.testing.assert_close(lora_expand_silu_triton(out, y, lora_b, slots, config=dict(BLOCK_M=16), order=order),
                               silu_and_mul_triton(got), atol=2 * ulps(dtype), rtol=2 * ulps(dtype))
    applied = out.clone()
    lora_apply(applied, x, lora_a, lora_b, slots, (0, 24), use_kernel=True, order=order)
    full = out.clone()
    lora_expand_ref(full, lora_shrink_ref(x, lora_a, slots), lora_b, slots, (0, 24))
    torch.testing.assert_close(applied, full, atol=ulps(dtype), rtol=ulps(dtype))


def test_order_must_cover_the_rows(device):
    x, lora_a, lora_b, y, out, slots = make_case(4, 24, (16, 8), 8, 2, torch.float32, [0, 1, -1, 1], device)
    with pytest.raises(ValueError, match="order"):
        lora_shrink_triton(x, lora_a, slots, order=slots[:3])
    with pytest.raises(ValueError, match="order"):
        lora_expand_triton(out, y, lora_b, slots, (0, 16), order=slots.float())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [64, 256])
@pytest.mark.parametrize("layer", LLAMA3_8B)
def test_gpu_sorted_rows_llama3_8b(layer, num_tokens, cuda):
    """Decode batches of 8 interleaved adapters (and base rows) tiled sorted by slot, as the engine runs them."""
    in_features, widths = LLAMA3_8B[layer]
    x, lora_a, lora_b, _, out, slots = make_case(num_tokens, in_features, widths, 16, 8, torch.bfloat16,
                                                 decode_slots(num_tokens, 8), cuda)
    order = torch.argsort(slots).to(torch.int32)
    expected = out.clone()
    lora_expand_ref(expected, lora_shrink_ref(x, lora_a, slots), lora_b, slots, starts_of(widths))
    got = out.clone()
    lora_apply(got, x, lora_a, lora_b, slots, starts_of(widths), order=order)
    torch.testing.assert_close(got, expected, atol=ulps(out.dtype), rtol=ulps(out.dtype))
    if len(widths) == 2:
        act = lora_silu_and_mul(out.clone(), x, lora_a, lora_b, slots, order=order)  # the expand inside
        tol = 2 * ulps(out.dtype)
        torch.testing.assert_close(act, silu_and_mul_triton(got), atol=tol, rtol=tol)
