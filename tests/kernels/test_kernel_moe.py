"""Fused MoE: the router and the reference against transformers' Mixtral / Qwen2-MoE modules, the expert alignment's
invariants, and the Triton grouped GEMMs against the reference across shapes that cross tile boundaries."""

import pytest
import torch

from kernels._triton import tl, triton
from kernels.moe import (
    align_by_expert_chunks,
    align_by_expert_ref,
    align_by_expert_triton,
    fused_moe,
    fused_moe_grouped_mm,
    fused_moe_ref,
    fused_moe_triton,
    grouped_tile,
    moe_config,
    takes_grouped_mm,
    topk_route,
    topk_route_ref,
    topk_route_triton,
)

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (3e-2, 3e-2)}


def make_case(num_tokens, hidden, inter, num_experts, top_k, dtype, device, renormalize=True, seed=0, skew=0.0):
    """x, w13, w2 and a routing from random router logits; skew > 0 pushes tokens towards expert 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += skew
    weights, ids = topk_route(logits, top_k, renormalize)
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def test_router_and_reference_are_transformers_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter

    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)
    x, w13, w2, _, _ = make_case(20, 32, 48, 6, 2, torch.float32, "cpu")
    router = MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    _, hf_weights, hf_ids = router(x)
    weights, ids = topk_route(x @ router.weight.T, 2, renormalize=True)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    experts = MixtralExperts(config)
    experts.gate_up_proj.data.copy_(w13)  # transformers keeps the same stacked layout
    experts.down_proj.data.copy_(w2)
    with torch.no_grad():
        expected = experts(x, hf_ids, hf_weights)
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids), expected)


def test_router_without_renormalization_is_transformers_qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    config = Qwen2MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)
    router = Qwen2MoeTopKRouter(config)
    torch.manual_seed(0)  # unseeded, the draw followed the tests before it: a token whose top 3 held all the mass
    torch.nn.init.normal_(router.weight)  # (sums 1.0 in float32) failed the strict < 1 below
    x = torch.randn(9, 32)
    _, hf_weights, hf_ids = router(x)
    weights, ids = topk_route(x @ router.weight.T, 3, renormalize=False)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert (weights.sum(-1) < 1).all()


ALIGN_CASES = [(1, 8, 2, 16), (37, 4, 2, 16), (50, 16, 1, 4), (3, 128, 8, 16)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", ALIGN_CASES)
def test_alignment_puts_every_pair_once_in_tiles_of_one_expert(num_tokens, num_experts, top_k, block_m):
    _, _, _, _, ids = make_case(num_tokens, 8, 8, num_experts, top_k, torch.float32, "cpu", skew=2.0)
    sorted_ids, tile_experts, num_padded = align_by_expert_ref(ids, num_experts, block_m)
    num_pairs, used = ids.numel(), int(num_padded)
    real = sorted_ids[:used][sorted_ids[:used] < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert (sorted_ids[used:] == num_pairs).all()  # nothing real past the padded total
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    for tile in range(used // block_m):
        rows = sorted_ids[tile * block_m:(tile + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert rows.numel() > 0 and (ids.flatten()[rows] == tile_experts[tile]).all()


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", ALIGN_CASES)
def test_one_program_alignment_equals_the_reference(num_tokens, num_experts, top_k, block_m, device,
                                                    poisoned_allocations):
    _, _, _, _, ids = make_case(num_tokens, 8, 8, num_experts, top_k, torch.float32, device, skew=2.0)
    for got, expected in zip(align_by_expert_triton(ids, num_experts, block_m),
                             align_by_expert_ref(ids, num_experts, block_m)):
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="exceed the one-program alignment"):
        align_by_expert_triton(torch.zeros(300, 8, dtype=torch.int64, device=device), 128, 16)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m",
                         ALIGN_CASES + [(300, 128, 8, 16), (257, 128, 8, 64), (2000, 8, 2, 64), (5, 256, 8, 16),
                                        (1000, 60, 4, 16)])
def test_chunked_alignment_equals_the_reference(num_tokens, num_experts, top_k, block_m, device,
                                                poisoned_allocations):
    """The three-kernel alignment (any batch; several chunks of pairs from 300 tokens x 8 of 128 experts on) gives
    the reference's outputs: pairs in order within each expert's padded run, the tiles' experts, the total."""
    _, _, _, _, ids = make_case(num_tokens, 8, 8, num_experts, top_k, torch.float32, device, skew=2.0)
    for got, expected in zip(align_by_expert_chunks(ids, num_experts, block_m),
                             align_by_expert_ref(ids, num_experts, block_m)):
        assert torch.equal(got, expected)


ROUTE_CASES = [(1, 8, 2, True), (37, 128, 8, True), (5, 60, 4, False), (20, 256, 8, True), (3, 6, 6, True)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize", ROUTE_CASES)
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_route_kernel_matches_the_reference(num_tokens, num_experts, top_k, renormalize, weights_dtype, device,
                                            poisoned_allocations):
    """float32 logits (no ties): the same experts in the same order, and the weights to float32 rounding (the
    kernel's exp is not torch's), then rounded to weights_dtype as the reference rounds them (one unit apart at
    most)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(device)
    weights, ids = topk_route_triton(logits, top_k, renormalize, weights_dtype)
    ref_weights, ref_ids = topk_route_ref(logits, top_k, renormalize, weights_dtype)
    assert torch.equal(ids, ref_ids) and weights.dtype == weights_dtype
    unit = 2.0 ** -7 if weights_dtype == torch.bfloat16 else 1e-6  # a bf16 unit: 2^-8 to 2^-7 of the value
    assert ((weights.float() - ref_weights.float()).abs() <= unit * ref_weights.float().abs().clamp(min=1e-3)).all()
    if renormalize and weights_dtype == torch.float32:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens, device=device))


@pytest.mark.parametrize("num_experts,top_k,groups,renormalize", [(160, 6, (8, 3), False), (64, 6, (8, 3), True),
                                                                   (64, 6, None, False), (24, 4, (4, 1), False)])
def test_route_kernel_is_deepseeks_routing(num_experts, top_k, groups, renormalize, device, poisoned_allocations):
    """DeepSeek's routing (workers/models/deepseek_v2.py DeepseekRouter): group-limited greedy (V2's 160 experts in 8
    groups, the best 3 kept; groups of a power-of-two count and of not), the renormalization with its 1e-20, or the
    routed scaling factor; the kernel against the reference, float32 logits."""
    logits = torch.randn(19, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(device)
    kwargs = dict(scale=16.0, renorm_eps=1e-20, groups=groups)
    weights, ids = topk_route_triton(logits, top_k, renormalize, **kwargs)
    ref_weights, ref_ids = topk_route_ref(logits, top_k, renormalize, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=0, rtol=1e-6)
    if groups is not None:  # every chosen expert in one of the topk_group kept groups
        per_group = num_experts // groups[0]
        assert all(len(set((row // per_group).tolist())) <= groups[1] for row in ids.cpu())


def test_route_kernel_takes_the_lowest_ids_among_ties(device):
    """Tied probabilities (equal logits, as bf16 router logits often are): the lowest expert ids first, which is
    the set CUDA's torch.topk keeps at the boundary (the values past the k-th, then the k-th's ties by index)."""
    logits = torch.tensor([[0.5, 0.9, 0.5, 0.5, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]], device=device)
    weights, ids = topk_route_triton(logits, 3, False)
    assert ids.tolist() == [[1, 0, 2], [0, 1, 2]]
    assert weights[0, 1] == weights[0, 2] and torch.allclose(weights[1], torch.full((3,), 0.2, device=device))


def test_route_dispatch_on_cpu_is_the_reference():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    for got, expected in zip(topk_route(logits, 4, True, torch.bfloat16), topk_route_ref(logits, 4, True,
                                                                                           torch.bfloat16)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_matches_the_reference(dtype, device):
    """The torch._grouped_mm form of the layer (sorted pairs, gathered rows, two grouped GEMMs, put back) against
    the experts loop, with experts no token chose among them."""
    if not hasattr(torch, "_grouped_mm") or (device.type == "cuda" and dtype != torch.bfloat16):
        pytest.skip("torch._grouped_mm: bf16 on a GPU")
    x, w13, w2, weights, ids = make_case(50, 64, 96, 16, 2, dtype, device, skew=2.0)
    torch.testing.assert_close(fused_moe_grouped_mm(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_grouped_mm_is_taken_for_large_experts_and_batches_only():
    """The measured rule (kernels/moe.py GROUPED_MM_*): never on CPU tensors; on a GPU, bf16 experts of at least
    GROUPED_MM_MIN_INTER columns with GROUPED_MM_PAIRS_PER_EXPERT pairs an expert."""
    from kernels.moe import GROUPED_MM_MIN_INTER, GROUPED_MM_PAIRS_PER_EXPERT

    w2 = torch.empty(8, 4, GROUPED_MM_MIN_INTER, dtype=torch.bfloat16)
    assert not takes_grouped_mm(torch.empty(1, 4, dtype=torch.bfloat16), w2, 8 * GROUPED_MM_PAIRS_PER_EXPERT)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        x, w2 = torch.empty(1, 4, dtype=torch.bfloat16, device="cuda"), w2.cuda()
        assert takes_grouped_mm(x, w2, 8 * GROUPED_MM_PAIRS_PER_EXPERT)
        assert not takes_grouped_mm(x, w2, 8 * GROUPED_MM_PAIRS_PER_EXPERT - 1)
        assert not takes_grouped_mm(x, w2[..., :GROUPED_MM_MIN_INTER // 2], 8 * GROUPED_MM_PAIRS_PER_EXPERT)


# Shapes: hidden and intermediate not multiples of the tiles; tokens from decode-sized to several tiles per expert.
SHAPES = [(1, 64, 48, 8, 2), (3, 96, 80, 4, 2), (37, 64, 48, 4, 1), (130, 32, 96, 8, 2),
          (80, 32, 16, 64, 4)]  # the last: too many pairs x experts for the one-program alignment


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k", SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_triton_matches_ref(num_tokens, hidden, inter, num_experts, top_k, renormalize, device,
                            poisoned_allocations):
    args = make_case(num_tokens, hidden, inter, num_experts, top_k, torch.float32, device, renormalize, skew=1.0)
    out = fused_moe_triton(*args)
    assert not out.isnan().any(), "a row of the output was not written"
    torch.testing.assert_close(out, fused_moe_ref(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype, device, poisoned_allocations):
    args = make_case(21, 64, 48, 4, 2, dtype, device)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(fused_moe_triton(*args), fused_moe_ref(*args), atol=atol, rtol=rtol)


@triton.jit
def _visit(out_ptr, num_tiles, num_n_blocks, GROUP_M: tl.constexpr):
    """Writes this program's (tile, n-block) (`grouped_tile`)."""
    tile, n_block = grouped_tile(num_tiles, num_n_blocks, GROUP_M)
    tl.store(out_ptr + tl.program_id(0) * 2, tile)
    tl.store(out_ptr + tl.program_id(0) * 2 + 1, n_block)


def test_grouped_tile_order_visits_every_tile_and_n_block_once(device):
    """`grouped_tile` over grids of tiles x n-blocks that GROUP_M divides and does not (a last group cut short):
    each (tile, n-block) exactly once; GROUP_M 1 is a tile's n-blocks in turn, and within a group the tiles run
    fastest."""
    for num_tiles, num_n_blocks, group_m in [(5, 3, 1), (5, 3, 2), (7, 4, 3), (8, 2, 8), (3, 5, 8), (17, 3, 8)]:
        out = torch.full((num_tiles * num_n_blocks, 2), -1, dtype=torch.int32, device=device)
        _visit[(num_tiles * num_n_blocks,)](out, num_tiles, num_n_blocks, GROUP_M=group_m)
        pairs = [tuple(p) for p in out.tolist()]
        assert sorted(pairs) == [(t, n) for t in range(num_tiles) for n in range(num_n_blocks)], pairs
        if group_m == 1:
            assert pairs == [(t, n) for t in range(num_tiles) for n in range(num_n_blocks)]
        assert [t for t, _ in pairs[:min(group_m, num_tiles)]] == list(range(min(group_m, num_tiles)))


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("group_m", [1, 3, 8])
def test_tile_sizes_never_change_results(block_m, group_m, device, poisoned_allocations):
    """All tokens but a few on one expert (several tiles of it), some experts with none; the tiles walked GROUP_M
    at a time (1: each tile's n-blocks in turn; 3: a last group cut short), every (tile, n-block) once."""
    args = make_case(45, 32, 40, 6, 2, torch.float32, device, skew=6.0)
    out = fused_moe_triton(*args, config={"BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": group_m})
    torch.testing.assert_close(out, fused_moe_ref(*args), atol=2e-5, rtol=2e-5)


def test_config_blocks_follow_rows_per_expert():
    cpu = torch.device("cpu")
    assert moe_config(2, 8, 14336, True, torch.bfloat16, cpu)["BLOCK_M"] == 16  # decode: a weight stream
    assert moe_config(64 * 2, 8, 14336, True, torch.bfloat16, cpu)["BLOCK_M"] == 16  # 16 rows per expert
    assert moe_config(8192 * 2, 8, 14336, True, torch.bfloat16, cpu)["BLOCK_M"] == 64


def test_public_function_on_cpu_is_the_reference():
    args = make_case(5, 16, 8, 4, 2, torch.float32, "cpu")
    assert torch.equal(fused_moe(*args), fused_moe_ref(*args))


def test_launcher_rejects_bad_inputs(device):
    x, w13, w2, weights, ids = make_case(4, 16, 8, 4, 2, torch.float32, device)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_triton(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="must have x's dtype"):
        fused_moe_triton(x, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights must be"):
        fused_moe_triton(x, w13, w2, weights[:2], ids[:2])


def test_gemms_with_different_tile_rows_are_refused(device, monkeypatch):
    import kernels.moe as moe

    real = moe.moe_config
    monkeypatch.setattr(moe, "moe_config", lambda n, e, out, gated, *rest: {**real(n, e, out, gated, *rest),
                                                                            "BLOCK_M": 16 if gated else 32})
    with pytest.raises(ValueError, match="share the expert alignment"):
        fused_moe_triton(*make_case(4, 16, 8, 4, 2, torch.float32, device))


MIXTRAL = dict(hidden=4096, inter=14336, num_experts=8, top_k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 1000])
def test_gpu_mixtral_sizes(num_tokens, cuda):
    c = MIXTRAL
    args = make_case(num_tokens, c["hidden"], c["inter"], c["num_experts"], c["top_k"], torch.bfloat16, cuda)
    out = fused_moe(*args)
    torch.testing.assert_close(out, fused_moe_ref(*args), atol=3e-2, rtol=3e-2)


QWEN3_30B_A3B = dict(hidden=2048, inter=768, num_experts=128, top_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,num_tokens", [(MIXTRAL, 8), (QWEN3_30B_A3B, 4), (QWEN3_30B_A3B, 64)],
                         ids=["mixtral-8", "qwen3-moe-4", "qwen3-moe-64"])  # the last: the torch alignment
def test_gpu_decode_in_a_cuda_graph(shape, num_tokens, cuda):
    """A decode step's MoE as the engine runs it: captured once, replayed with other routings."""
    c = shape
    x, w13, w2, weights, ids = make_case(num_tokens, c["hidden"], c["inter"], c["num_experts"], c["top_k"],
                                         torch.bfloat16, cuda)
    fused_moe(x, w13, w2, weights, ids)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in range(3):
        _, _, _, new_weights, new_ids = make_case(num_tokens, 8, 8, c["num_experts"], c["top_k"], torch.float32,
                                                  cuda, seed=seed + 1, skew=3.0 * seed)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=3e-2, rtol=3e-2)
