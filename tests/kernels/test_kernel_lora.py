"""Batched LoRA: the torch references against peft and against a per-token einsum, and the Triton shrink / expand
kernels against the references, over mixed slots (with -1), every slice layout, ranks 8-64 and the three dtypes,
at sizes that cross the row, column and K tiles, with the rows as they come and sorted by slot."""

import pytest
import torch

from kernels import _triton as triton_module
from kernels.lora import (
    expand_config,
    lora_expand,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink,
    lora_shrink_ref,
    lora_shrink_triton,
    shrink_config,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (slice widths): an o / down projection, gate/up, q/k/v of unequal widths (GQA), with widths off the tiles
LAYOUTS = {"one": (72,), "gate_up": (40, 40), "qkv": (96, 24, 24)}


def make_case(num_tokens, in_features, widths, rank, num_slots, dtype, slots, device, seed=0):
    """x, A [S, n, R, K], B [S, N, R], y float32 [n, T, R], out [T, N]; the rank's last quarter zero (padding)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    lora_a = torch.randn(num_slots, len(widths), rank, in_features, generator=gen) * in_features ** -0.5
    lora_b = torch.randn(num_slots, sum(widths), rank, generator=gen) * rank ** -0.5
    lora_a[:, :, rank - rank // 4:] = 0
    lora_b[:, :, rank - rank // 4:] = 0
    y = torch.randn(len(widths), num_tokens, rank, generator=gen)
    out = torch.randn(num_tokens, sum(widths), generator=gen)
    tensors = [t.to(dtype) for t in (x, lora_a, lora_b)] + [y, out.to(dtype)]
    return [t.to(device) for t in tensors] + [torch.as_tensor(slots, dtype=torch.int32, device=device)]


def starts_of(widths) -> tuple[int, ...]:
    return tuple(sum(widths[:i]) for i in range(len(widths)))


def decode_slots(num_tokens, num_slots, seed=0):
    """One row a sequence, each its own adapter or none (-1)."""
    return torch.randint(-1, num_slots, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_slots(lengths_and_slots):
    """Runs of rows: a sequence's tokens share its slot."""
    return [slot for length, slot in lengths_and_slots for _ in range(length)]


def shrink_oracle(x, lora_a, slots):
    """Per token: its adapter's A gathered, y = A @ x, in float64."""
    a = lora_a[slots.long().clamp(min=0)].double()  # [T, n, R, K]
    y = torch.einsum("tk,tirk->itr", x.double(), a)
    return (y * (slots >= 0).double()[None, :, None]).float()


def expand_oracle(out, y, lora_b, slots, starts):
    b = lora_b[slots.long().clamp(min=0)].double()  # [T, N, R]
    cols = torch.arange(out.shape[1])
    slice_of = torch.searchsorted(torch.tensor(starts), cols, right=True) - 1  # -1: before the first slice
    y_cols = y.double()[slice_of.clamp(min=0)]  # [N, T, R]: each column's slice
    delta = torch.einsum("ntr,tnr->tn", y_cols, b) * (slice_of >= 0).double()
    expected = (out.double() + delta).to(out.dtype)
    return torch.where((slots >= 0)[:, None], expected, out)


def ulps(dtype) -> float:
    return {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_references_match_a_per_token_einsum(layout, dtype):
    widths = LAYOUTS[layout]
    x, lora_a, lora_b, y, out, slots = make_case(23, 40, widths, 8, 3, dtype, decode_slots(23, 3), "cpu")
    torch.testing.assert_close(lora_shrink_ref(x, lora_a, slots), shrink_oracle(x, lora_a, slots),
                               atol=1e-5, rtol=1e-5)
    expected = expand_oracle(out, y, lora_b, slots, starts_of(widths))
    lora_expand_ref(out, y, lora_b, slots, starts_of(widths))
    torch.testing.assert_close(out, expected, atol=ulps(dtype), rtol=ulps(dtype))  # float32 vs float64 sums


def test_references_are_peft_lora_linear():
    """Each row: base(x) + its adapter's peft LoRA (alpha / r folded into B), or base(x) alone for slot -1."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(40, 56, bias=False))
    adapters = []
    for alpha in (8, 32):
        model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(40, 56, bias=False)),
                               LoraConfig(r=8, lora_alpha=alpha, target_modules=["0"]))
        layer = model.base_model.model[0]
        layer.base_layer.weight.data.copy_(base[0].weight)
        torch.nn.init.normal_(layer.lora_B["default"].weight)
        adapters.append(model)
    x = torch.randn(7, 40)
    slots = torch.tensor([0, 1, -1, 1, 0, 0, -1], dtype=torch.int32)
    lora_a = torch.stack([m.base_model.model[0].lora_A["default"].weight for m in adapters])[:, None]  # [2,1,8,40]
    lora_b = torch.stack([m.base_model.model[0].lora_B["default"].weight * m.base_model.model[0].scaling["default"]
                          for m in adapters])  # [2, 56, 8]
    with torch.no_grad():
        out = base(x)
        lora_expand_ref(out, lora_shrink_ref(x, lora_a, slots), lora_b, slots, (0,))
        expected = torch.stack([(adapters[s](x[t:t + 1]) if s >= 0 else base(x[t:t + 1]))[0]
                                for t, s in enumerate(slots.tolist())])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


SLOT_PATTERNS = {
    "decode": lambda t, s: decode_slots(t, s, seed=t),
    "prefill": lambda t, s: prefill_slots([(t // 3, 1), (t - 2 * (t // 3), -1), (t // 3, s - 1)]),
    "one adapter": lambda t, s: [s - 1] * t,
    "none": lambda t, s: [-1] * t,
}


def check_shrink(x, lora_a, slots, config=None):
    y = lora_shrink_triton(x, lora_a, slots, config=config)
    assert y.dtype == torch.float32 and y.shape == (lora_a.shape[1], x.shape[0], lora_a.shape[2])
    torch.testing.assert_close(y, lora_shrink_ref(x, lora_a, slots), atol=1e-5, rtol=1e-4)


def check_expand(out, y, lora_b, slots, starts, config=None):
    before, expected = out.clone(), out.clone()
    lora_expand_ref(expected, y, lora_b, slots, starts)
    lora_expand_triton(out, y, lora_b, slots, starts, config=config)
    assert torch.equal(out[slots < 0], before[slots < 0])  # rows without an adapter untouched, bit for bit
    # one rounding of float32 sums taken in another order: at most one unit in the last place apart
    tol = ulps(out.dtype)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("num_tokens", [1, 21, 70])  # one 16-row tile, 32-row tiles, 64-row tiles with a ragged end
def test_shrink_and_expand_match_references(num_tokens, pattern, dtype, device):
    widths = LAYOUTS["qkv"]
    slots = SLOT_PATTERNS[pattern](num_tokens, 4)
    x, lora_a, lora_b, y, out, slots = make_case(num_tokens, 72, widths, 16, 4, dtype, slots, device)
    check_shrink(x, lora_a, slots)
    check_expand(out, y, lora_b, slots, starts_of(widths))


@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_and_slice_layout(layout, rank, device, poisoned_allocations):
    """y written whole (no unwritten rank or row reads as NaN), ranks below the 16 a dot needs padded."""
    widths = LAYOUTS[layout]
    x, lora_a, lora_b, y, out, slots = make_case(19, 40, widths, rank, 3, torch.bfloat16, decode_slots(19, 3),
                                                 device)
    check_shrink(x, lora_a, slots)
    check_expand(out, y, lora_b, slots, starts_of(widths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_and_narrow_tiles(dtype, device):
    """Shrink's K split over programs (partial sums added by each tile's last program) with a ragged last split and
    an empty one, and expand's column tiles straddling nothing: each slice's blocks start at its own first column."""
    widths = (40, 12, 20)
    x, lora_a, lora_b, y, out, slots = make_case(37, 100, widths, 16, 4, dtype, decode_slots(37, 4), device)
    check_shrink(x, lora_a, slots, config=dict(BLOCK_M=16, BLOCK_K=16, SPLIT_K=3))
    check_shrink(x, lora_a, slots, config=dict(BLOCK_M=16, BLOCK_K=16, SPLIT_K=8))  # 7 K blocks: one split empty
    check_shrink(x, lora_a, slots, config=dict(BLOCK_M=32, BLOCK_K=32, SPLIT_K=1))
    check_expand(out, y, lora_b, slots, starts_of(widths), config=dict(BLOCK_M=16, BLOCK_N=16))
    check_expand(out, y, lora_b, slots, starts_of(widths), config=dict(BLOCK_M=16, BLOCK_N=16, OUT_FIRST=True))


def test_strided_views(device):
    """x and out as column windows of wider tensors, y with padded rows: the launchers pass strides, not shapes."""
    widths = LAYOUTS["qkv"]
    x, lora_a, lora_b, y, out, slots = make_case(21, 40, widths, 16, 3, torch.float16, decode_slots(21, 3), device)
    wide_x = torch.zeros(21, 47, dtype=x.dtype, device=device)
    wide_x[:, 5:45] = x
    padded_y = torch.zeros(3, 21, 19, device=device)
    padded_y[:, :, :16] = y
    wide_out = torch.zeros(21, sum(widths) + 9, dtype=out.dtype, device=device)
    wide_out[:, 3:3 + sum(widths)] = out
    check_shrink(wide_x[:, 5:45], lora_a, slots)
    check_expand(wide_out[:, 3:3 + sum(widths)], padded_y[:, :, :16], lora_b, slots, starts_of(widths))
    assert not wide_out[:, :3].any() and not wide_out[:, 3 + sum(widths):].any()


def test_slices_need_not_start_at_zero_nor_be_wide(device):
    """Columns before the first slice untouched; an empty slice launches no block."""
    x, lora_a, lora_b, y, out, slots = make_case(9, 24, (10, 0, 30), 16, 2, torch.float16, decode_slots(9, 2), device)
    check_expand(out, y, lora_b, slots, (6, 10, 10))
    before = out.clone()
    lora_expand_triton(out, y, lora_b, slots, (6, 10, 10))
    assert torch.equal(out[:, :6], before[:, :6])


SORTED_PATTERNS = {**SLOT_PATTERNS, "padded": lambda t, s: decode_slots(t - 5, s, seed=t) + [-1] * 5}


@pytest.mark.parametrize("order_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", SORTED_PATTERNS)
def test_rows_sorted_by_slot_give_the_same_results(pattern, dtype, order_dtype, device):
    """order = argsort(slots), as InputBuffers computes it: shrink and expand tile the sorted rows (their x, y and
    out rows gathered; a tile of interleaved adapters then holds few) and give what the references give,
    rows without an adapter (-1, interleaved or the padding at the end) untouched; the public functions pass it on."""
    num_tokens, widths = 37, (24, 8, 16)
    slots = SORTED_PATTERNS[pattern](num_tokens, 4)
    x, lora_a, lora_b, y, out, slots = make_case(num_tokens, 40, widths, 16, 4, dtype, slots, device)
    order = torch.argsort(slots.cpu(), stable=True).to(device=device, dtype=order_dtype)
    for config in (dict(BLOCK_M=16, SPLIT_K=1), dict(BLOCK_M=16, BLOCK_K=16, SPLIT_K=2)):  # 3 row tiles
        torch.testing.assert_close(lora_shrink_triton(x, lora_a, slots, config=config, order=order),
                                   lora_shrink_ref(x, lora_a, slots), atol=1e-5, rtol=1e-4)
    expected, got = out.clone(), out.clone()
    lora_expand_ref(expected, y, lora_b, slots, starts_of(widths))
    lora_expand_triton(got, y, lora_b, slots, starts_of(widths), config=dict(BLOCK_M=16, BLOCK_N=16), order=order)
    torch.testing.assert_close(got, expected, atol=ulps(dtype), rtol=ulps(dtype))
    assert torch.equal(got[slots < 0], out[slots < 0])
    applied, full = out.clone(), out.clone()  # the public functions at their default tiles (32 rows: two tiles)
    lora_expand(applied, lora_shrink(x, lora_a, slots, use_kernel=True, order=order), lora_b, slots,
                starts_of(widths), use_kernel=True, order=order)
    lora_expand_ref(full, lora_shrink_ref(x, lora_a, slots), lora_b, slots, starts_of(widths))
    torch.testing.assert_close(applied, full, atol=ulps(dtype), rtol=ulps(dtype))


def test_tiles_read_through_the_order_unless_the_rows_fit_one(device, poisoned_allocations):
    """An order naming row 0 everywhere: over several tiles the shrink computes row 0 alone and the other rows of y
    stay unwritten (NaN here), so the tiles read through it; rows that fit one tile ignore it (its walk is the
    same either way)."""
    x, lora_a, _, _, _, slots = make_case(20, 24, (16,), 8, 2, torch.float32, decode_slots(20, 2), device)
    order = torch.zeros(20, dtype=torch.int32, device=device)
    y = lora_shrink_triton(x, lora_a, slots, config=dict(BLOCK_M=16, SPLIT_K=1), order=order)
    assert not y[:, 0].isnan().any() and y[:, 1:].isnan().all()
    torch.testing.assert_close(lora_shrink_triton(x, lora_a, slots, config=dict(BLOCK_M=32, SPLIT_K=1), order=order),
                               lora_shrink_ref(x, lora_a, slots), atol=1e-5, rtol=1e-4)


def test_order_must_cover_the_rows(device):
    x, lora_a, lora_b, y, out, slots = make_case(4, 24, (16, 8), 8, 2, torch.float32, [0, 1, -1, 1], device)
    with pytest.raises(ValueError, match="order"):
        lora_shrink_triton(x, lora_a, slots, order=slots[:3])
    with pytest.raises(ValueError, match="order"):
        lora_expand_triton(out, y, lora_b, slots, (0, 16), order=slots.float())


def test_a_call_that_differs_from_a_planned_one_is_checked_again(device):
    """The launchers keep each call signature's checked plan: a call that follows a good one with the same shapes
    but a bad slots dtype, order, slice starts or dtype is still refused, and the good one still computes."""
    x, lora_a, lora_b, y, out, slots = make_case(4, 24, (16, 8), 8, 2, torch.float32, [0, 1, -1, 1], device)
    order = torch.argsort(slots).to(torch.int32)
    expected = out.clone()
    lora_expand_ref(expected, y, lora_b, slots, (0, 16))
    for _ in range(2):  # the second time from the plans
        torch.testing.assert_close(lora_shrink_triton(x, lora_a, slots, order=order), lora_shrink_ref(x, lora_a, slots),
                                   atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink_triton(x, lora_a, slots.float(), order=order)
    with pytest.raises(ValueError, match="order"):
        lora_shrink_triton(x, lora_a, slots, order=order[:3])
    with pytest.raises(ValueError, match="lora_a"):
        lora_shrink_triton(x, lora_a.double(), slots, order=order)
    got = out.clone()
    lora_expand_triton(got, y, lora_b, slots, (0, 16), order=order)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="slice_starts"):
        lora_expand_triton(out, y, lora_b, slots, (16, 0), order=order)
    with pytest.raises(ValueError, match="slice_starts"):
        lora_expand_triton(out, y, lora_b, slots, [0, 16.0], order=order)
    with pytest.raises(ValueError, match="order"):
        lora_expand_triton(out, y, lora_b, slots, (0, 16), order=order.float())


def test_split_k_sums_in_a_fixed_order_and_leaves_its_counts_at_zero(device):
    """The tiles' last programs add the parts in split order: the same y bit for bit on every launch (the atomics
    they replace varied in the low bits), with the arrival counts back at 0 for the next launch (a CUDA graph
    replays the same counts), and no zeroed y needed."""
    x, lora_a, lora_b, y, out, slots = make_case(19, 256, (32, 16), 16, 3, torch.bfloat16, decode_slots(19, 3),
                                                 device)
    config = dict(BLOCK_M=16, BLOCK_K=32, SPLIT_K=4)
    first = lora_shrink_triton(x, lora_a, slots, config=config)
    torch.testing.assert_close(first, lora_shrink_ref(x, lora_a, slots), rtol=1e-5, atol=1e-5)
    for _ in range(2):
        assert torch.equal(lora_shrink_triton(x, lora_a, slots, config=config), first)
    assert not triton_module._SPLIT_COUNTS[(x.device, "lora shrink")].any()
    with pytest.raises(ValueError, match="MAX_SHRINK_PARTS"):
        lora_shrink_triton(x, lora_a, slots, config=dict(BLOCK_M=64, SPLIT_K=16))


def test_decode_defaults_split_k_and_prefill_does_not():
    cpu = torch.device("cpu")
    assert shrink_config(1, 4096, 16, 3, torch.bfloat16, cpu)["SPLIT_K"] > 1
    assert shrink_config(2048, 4096, 16, 3, torch.bfloat16, cpu)["SPLIT_K"] == 1
    assert expand_config(1, 16, torch.bfloat16)["BLOCK_M"] == 16 and expand_config(2048, 64, torch.bfloat16)[
        "BLOCK_M"] == 64


def test_empty_batch(device):
    x, lora_a, lora_b, y, out, slots = make_case(0, 24, (16,), 8, 2, torch.float32, [], device)
    assert lora_shrink_triton(x, lora_a, slots).shape == (1, 0, 8)
    lora_expand_triton(out, y, lora_b, slots, (0,))
    assert lora_shrink_ref(x, lora_a, slots).shape == (1, 0, 8)


def test_public_functions_take_the_reference_on_cpu():
    x, lora_a, lora_b, y, out, slots = make_case(5, 24, (16, 8), 8, 2, torch.bfloat16, [0, 1, -1, 1, 0], "cpu")
    assert torch.equal(lora_shrink(x, lora_a, slots), lora_shrink_ref(x, lora_a, slots))
    expected = out.clone()
    lora_expand_ref(expected, y, lora_b, slots, (0, 16))
    lora_expand(out, y, lora_b, slots, (0, 16))
    assert torch.equal(out, expected)


def test_public_functions_run_the_kernel_when_asked(device):
    """use_kernel=True: the Triton kernels (here under the interpreter), as a model test on CPU may ask."""
    x, lora_a, lora_b, y, out, slots = make_case(5, 24, (16, 8), 8, 2, torch.bfloat16, [0, 1, -1, 1, 0], device)
    y_kernel = lora_shrink(x, lora_a, slots, use_kernel=True)
    assert torch.equal(y_kernel, lora_shrink_triton(x, lora_a, slots))
    expected = out.clone()
    lora_expand_triton(expected, y, lora_b, slots, (0, 16))
    lora_expand(out, y, lora_b, slots, (0, 16), use_kernel=True)
    assert torch.equal(out, expected)


def test_bad_inputs_name_the_argument(device):
    x, lora_a, lora_b, y, out, slots = make_case(4, 24, (16, 8), 8, 2, torch.float32, [0, 1, -1, 1], device)
    for fn in (lora_shrink_triton, lora_shrink_ref):
        with pytest.raises(ValueError, match="lora_a"):
            fn(x, lora_a[..., :20], slots)
        with pytest.raises(ValueError, match="lora_a"):
            fn(x, lora_a.half(), slots)
        with pytest.raises(ValueError, match="slots"):
            fn(x, lora_a, slots[:3])
        with pytest.raises(ValueError, match="slots"):
            fn(x, lora_a, slots.float())
        with pytest.raises(ValueError, match="x must be"):
            fn(x[0], lora_a, slots)
    for fn in (lora_expand_triton, lora_expand_ref):
        with pytest.raises(ValueError, match="lora_b"):
            fn(out, y, lora_b[:, :20], slots, (0, 16))
        with pytest.raises(ValueError, match="y must be"):
            fn(out, y[:, :, :4], lora_b, slots, (0, 16))
        with pytest.raises(ValueError, match="y must"):
            fn(out, y.half(), lora_b, slots, (0, 16))
        with pytest.raises(ValueError, match="slice_starts"):
            fn(out, y, lora_b, slots, (0,))
        with pytest.raises(ValueError, match="slice_starts"):
            fn(out, y, lora_b, slots, (16, 0))
        with pytest.raises(ValueError, match="lora_b"):
            fn(out, y, lora_b.half(), slots, (0, 16))
    with pytest.raises(ValueError, match="slots must lie in"):
        lora_shrink_ref(x, lora_a, torch.tensor([0, 2, -1, 1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="MAX_RANK"):
        big = make_case(4, 24, (16,), 129, 1, torch.float32, [0, 0, 0, 0], device)
        lora_shrink_triton(big[0], big[1], big[5])


LLAMA3_8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
             "down": (14336, (4096,))}


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 2048])
@pytest.mark.parametrize("layer", LLAMA3_8B)
def test_gpu_llama3_8b_layers(layer, num_tokens, cuda):
    in_features, widths = LLAMA3_8B[layer]
    slots = (decode_slots(num_tokens, 8) if num_tokens <= 256 else
             prefill_slots([(num_tokens // 8, s - 1) for s in range(8)]))
    for rank in (16, 64):
        x, lora_a, lora_b, y, out, slots_t = make_case(num_tokens, in_features, widths, rank, 8, torch.bfloat16,
                                                       slots, cuda)
        torch.testing.assert_close(lora_shrink(x, lora_a, slots_t), lora_shrink_ref(x, lora_a, slots_t),
                                   atol=1e-4, rtol=1e-3)
        check_expand(out, y, lora_b, slots_t, starts_of(widths))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [64, 256])
@pytest.mark.parametrize("layer", LLAMA3_8B)
def test_gpu_sorted_rows_llama3_8b(layer, num_tokens, cuda):
    """Decode batches over 8 interleaved adapters (and base rows) tiled sorted by slot, as the engine runs them."""
    in_features, widths = LLAMA3_8B[layer]
    x, lora_a, lora_b, _, out, slots = make_case(num_tokens, in_features, widths, 16, 8, torch.bfloat16,
                                                 decode_slots(num_tokens, 8), cuda)
    order = torch.argsort(slots).to(torch.int32)
    expected, got = out.clone(), out.clone()
    lora_expand_ref(expected, lora_shrink_ref(x, lora_a, slots), lora_b, slots, starts_of(widths))
    lora_expand(got, lora_shrink(x, lora_a, slots, order=order), lora_b, slots, starts_of(widths), order=order)
    torch.testing.assert_close(got, expected, atol=ulps(out.dtype), rtol=ulps(out.dtype))
    assert torch.equal(got[slots < 0], out[slots < 0])


@pytest.mark.gpu
@pytest.mark.parametrize("is_sorted", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_gpu_decode_in_a_cuda_graph(num_tokens, is_sorted, cuda):
    """A decode step's LoRA as the engine runs it: shrink and expand captured once, replayed with other slots
    (written into the captured slots tensor, and their argsort into the captured order) and other inputs."""
    in_features, widths = LLAMA3_8B["qkv"]
    x, lora_a, lora_b, _, out, slots = make_case(num_tokens, in_features, widths, 16, 8, torch.bfloat16,
                                                 decode_slots(num_tokens, 8), cuda)
    base = out.clone()
    order = torch.argsort(slots).to(torch.int32) if is_sorted else None

    def step():
        out.copy_(base)
        lora_expand(out, lora_shrink(x, lora_a, slots, order=order), lora_b, slots, starts_of(widths), order=order)

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(1, 4):
        slots.copy_(torch.tensor(decode_slots(num_tokens, 8, seed=seed), dtype=torch.int32))
        if order is not None:
            order.copy_(torch.argsort(slots))
        x.copy_(torch.randn_like(x))
        graph.replay()
        expected = base.clone()
        lora_expand_ref(expected, lora_shrink_ref(x, lora_a, slots), lora_b, slots, starts_of(widths))
        torch.testing.assert_close(out, expected, atol=ulps(out.dtype), rtol=ulps(out.dtype))


@pytest.mark.slow  # the benchmark at toy sizes under the interpreter: make test-slow and CI run it
def test_benchmark_runs_and_checks_at_toy_sizes(device, monkeypatch, capsys):
    """benchmarks/kernels_lora.py at toy sizes (its GPU run is the lead's): every case builds, checks the kernels
    against the references and times each impl (once here), and the overhead lines come out."""
    import benchmarks.kernels as bench
    from benchmarks.kernels_lora import (
        SMOKE_LORA,
        TUNE_EXPAND,
        TUNE_SHRINK,
        bench_lora,
        bench_tune_lora,
        lora_bytes,
        print_lora_overhead,
    )

    monkeypatch.setattr(bench, "time_ms", lambda fn, device: (fn(), 1.0)[1])
    runner = bench.Runner(device, check=True, use_triton=True)
    lora_cfg = dict(SMOKE_LORA, decode_batches=[3], prefill_tokens=[20])
    bench_lora(runner, {"dtype": torch.bfloat16}, lora_cfg)
    assert not runner.failures, runner.failures
    impls = {(r["kernel"], r["case"], r["impl"]) for r in runner.results}
    assert impls == {(f"lora {layer}", f"{case} r16", impl) for layer in ("qkv", "down")
                     for case in ("decode batch 3", "prefill 20 tokens")
                     for impl in ("base matmul", "lora triton", "lora sorted", "base + lora", "lora torch ref")}
    print_lora_overhead(runner.results)
    assert "lora overhead qkv      decode batch 3 r16" in capsys.readouterr().out
    x, weight = torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    work = lora_bytes(x, weight, torch.zeros(4, 3, 16, 64, dtype=torch.bfloat16),
                      torch.zeros(4, 128, 16, dtype=torch.bfloat16), torch.tensor([0, 2, 2], dtype=torch.int32))
    # x, 2 adapters' A (3 x 16 x 64) and B (128 x 16), y written and read, out read and written
    assert work["bytes"] == 3 * 64 * 2 + 2 * 3 * 16 * 64 * 2 + 2 * 128 * 16 * 2 + 2 * 3 * 3 * 16 * 4 + 2 * 3 * 128 * 2
    assert work["impl_bytes"]["base matmul"] == 128 * 64 * 2 + 3 * 64 * 2 + 3 * 128 * 2
    tune = bench.Runner(device, check=False, use_triton=True)
    bench_tune_lora(tune, {"dtype": torch.bfloat16}, dict(lora_cfg, prefill_tokens=[]))
    assert not tune.failures and len(tune.results) == 2 * (2 + len(TUNE_SHRINK) + len(TUNE_EXPAND))  # qkv, down
