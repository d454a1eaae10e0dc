"""Fused mixture of experts: each token's routed experts (SiLU MLPs) over a flat batch, as grouped GEMMs.

    x [T, H], topk_ids / topk_weights [T, K]  ->  out[t] = sum_k  w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
                                                   with e = topk_ids[t, k]

All experts' weights are stacked: w13 [E, 2 I, H] (each expert's gate rows, then its up rows) and w2 [E, H, I].
The T * K (token, slot) pairs, pair = t * K + k, are sorted by expert and each expert's run is padded to a multiple
of BLOCK_M (`align_by_expert`: one small kernel for decode-sized batches, three beyond), so that every BLOCK_M-row
tile belongs to one expert (pairs in order within an expert):

    sorted pair ids   [ 0  4  7  - | 1  2  3  5 | 6  -  -  - | ... ]      BLOCK_M = 4, "-" padding (skipped)
    tile experts      [ 0          | 2          | 2          | ... ]

One launch of `_moe_gemm_kernel` then computes every tile against its expert's weights (grid: tiles x column
blocks; the tiles past the padded total return at once). It runs twice per layer: gate/up with SiLU-and-mul
fused (the tile's rows of x gathered by pair // K) into h [T * K, I], then down, each row scaled by its routing
weight, into [T * K, H]; the K slots of a token are summed last, in torch (deterministic, no atomics).

No host sync (sizes are upper bounds; the padded total stays on the device), so a decode step is CUDA-graph
capturable. An expert no token chose is never read: a batch-1 step reads only its K experts' weights.

Numerics follow transformers' experts loop: gate and up rounded to the dtype, silu rounded, the product rounded,
down rounded, then times the routing weight (in float32, rounded once), and the slots summed.
"""

import functools

import torch
import torch.nn.functional as F

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    next_power_of_2,
    pdl_options,
    shared_memory_per_block,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.activation import silu_and_mul
from kernels.linear import rows_times_weight, silu_mul_rounded


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               weights_dtype: torch.dtype = torch.float32, scale: float = 1.0, renorm_eps: float = 0.0,
               groups: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over experts in float32, the top_k, renormalized to sum 1 when asked (Mixtral always, Qwen-MoE with
    norm_topk_prob): (weights [T, top_k] rounded to weights_dtype (Qwen rounds them to the model's dtype), expert
    ids int64 [T, top_k]), as transformers' routers. DeepSeek's: groups=(n_group, topk_group) keeps the experts of
    the topk_group groups whose best score is highest (group-limited greedy: the others score 0), renorm_eps is
    added to the renormalization's sum, and weights not renormalized are multiplied by scale
    (routed_scaling_factor). On a GPU one kernel (`topk_route_triton`), where torch runs some six a layer (with the
    chunked alignment, a Qwen3-30B-A3B decode step on an H100 went from 5.00 to 4.31 ms/token at batch 1:
    docs/benchmarks.md)."""
    if (use_triton(router_logits) and router_logits.shape[-1] <= MAX_ROUTE_EXPERTS and top_k <= MAX_ROUTE_TOP_K
            and (groups is None or groups[0] <= MAX_ROUTE_GROUPS)):
        return topk_route_triton(router_logits, top_k, renormalize, weights_dtype, scale, renorm_eps, groups)
    return topk_route_ref(router_logits, top_k, renormalize, weights_dtype, scale, renorm_eps, groups)


def topk_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype = torch.float32, scale: float = 1.0, renorm_eps: float = 0.0,
                   groups: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `topk_route` (and its CPU implementation)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    if groups is not None:
        n_group, topk_group = groups
        grouped = probs.unflatten(-1, (n_group, -1))  # [T, n_group, E / n_group]
        best_groups = grouped.amax(dim=-1).topk(topk_group, dim=-1).indices  # [T, topk_group]
        kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        probs = grouped.masked_fill(~kept[..., None], 0.0).flatten(1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + renorm_eps)
    elif scale != 1.0:
        weights = weights * scale
    return weights.to(weights_dtype), ids


MAX_ROUTE_EXPERTS = 1024  # a row of router logits the kernel holds in registers
MAX_ROUTE_TOP_K = 32
MAX_ROUTE_GROUPS = 32


@triton.jit
def _take_best(scores, ids, PAD: tl.constexpr):
    """Each row's largest score [rows], the lowest of the ids [PAD] holding it [rows], and the scores with that one
    removed (-2: below any score left, probabilities and the -1 of padding)."""
    best = tl.max(scores, 1)
    best_id = tl.min(tl.where(scores == best[:, None], ids[None, :], PAD), 1)
    return best, best_id, tl.where(ids[None, :] == best_id[:, None], -2.0, scores)


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_l, scale, renorm_eps,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, SCALE: tl.constexpr,
                       N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_T tokens a program: the softmax of each row in float32; with N_GROUP > 1 only the experts of the
    TOPK_GROUP groups of highest best score kept (the others score 0, as DeepSeek masks them); then TOP_K rounds of
    (largest probability, its lowest expert id), removed before the next; renormalized over the chosen ones, or
    times scale."""
    wait_for_prior(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    is_token = tokens < num_tokens
    valid = is_token[:, None] & (experts[None, :] < num_experts)
    logits = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * stride_l + experts[None, :], mask=valid,
                     other=-float("inf")).to(tl.float32)
    shifted = logits - tl.where(is_token, tl.max(logits, 1), 0.0)[:, None]
    e = tl.where(valid, tl.exp(shifted), 0.0)
    probs = e / tl.where(is_token, tl.sum(e, 1), 1.0)[:, None]
    if N_GROUP > 1:
        group_of = experts // (num_experts // N_GROUP)  # [BLOCK_E]; past num_experts: N_GROUP or more
        group_ids = tl.arange(0, GROUP_PAD)
        best = tl.full([BLOCK_T, GROUP_PAD], -1.0, tl.float32)  # each group's best score (-1: no such group)
        for g in tl.static_range(N_GROUP):
            in_g = valid & (group_of[None, :] == g)
            best = tl.where(group_ids[None, :] == g, tl.max(tl.where(in_g, probs, -1.0), 1)[:, None], best)
        kept = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            _, top_id, best = _take_best(best, group_ids, GROUP_PAD)
            kept = kept | (group_of[None, :] == top_id[:, None]).to(tl.int32)
        probs = tl.where(kept != 0, probs, 0.0)
    probs = tl.where(valid, probs, -1.0)  # below any probability: never chosen
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    chosen_ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for k in tl.static_range(TOP_K):
        best_p, best_id, probs = _take_best(probs, experts, BLOCK_E)
        chosen = tl.where(slots[None, :] == k, best_p[:, None], chosen)
        chosen_ids = tl.where(slots[None, :] == k, best_id[:, None], chosen_ids)
    if RENORMALIZE:
        chosen = chosen / (tl.sum(tl.where(slots[None, :] < TOP_K, chosen, 0.0), 1)[:, None] + renorm_eps)
    elif SCALE:
        chosen = chosen * scale
    out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = is_token[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, chosen.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, chosen_ids.to(tl.int64), mask=mask)


def topk_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                      weights_dtype: torch.dtype = torch.float32, scale: float = 1.0, renorm_eps: float = 0.0,
                      groups: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `topk_route` (logits [T, E], E <= MAX_ROUTE_EXPERTS, top_k <= MAX_ROUTE_TOP_K, groups
    (n_group <= MAX_ROUTE_GROUPS dividing E, topk_group) or None)."""
    check_launchable(router_logits)
    check_last_dim_contiguous("router_logits", router_logits)
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= min(num_experts, MAX_ROUTE_TOP_K) or num_experts > MAX_ROUTE_EXPERTS:
        raise ValueError(f"top_k {top_k} of {num_experts} experts: the kernel takes 1..{MAX_ROUTE_TOP_K} of at most "
                         f"{MAX_ROUTE_EXPERTS}")
    n_group, topk_group = groups if groups is not None else (1, 1)
    if not 0 < n_group <= MAX_ROUTE_GROUPS or num_experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"groups {groups}: n_group must divide the {num_experts} experts (at most "
                         f"{MAX_ROUTE_GROUPS}) and topk_group be in 1..n_group")
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        block_e = next_power_of_2(num_experts)
        block_t = max(1, min(16, 2048 // block_e))  # one variant for every batch
        _topk_route_kernel[(cdiv(num_tokens, block_t),)](
            router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0), float(scale),
            float(renorm_eps), TOP_K=top_k, K_PAD=next_power_of_2(top_k), RENORMALIZE=renormalize,
            SCALE=scale != 1.0, N_GROUP=n_group, TOPK_GROUP=topk_group, GROUP_PAD=next_power_of_2(n_group),
            BLOCK_T=block_t, BLOCK_E=block_e, **pdl_options(router_logits.device), num_warps=4)
    return weights, ids


def _num_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound from the shapes alone: at most min(T * K, E) experts have rows, each padded by < block_m."""
    return cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)


@triton.jit(do_not_specialize=["num_pairs", "num_tiles"])
def _align_kernel(ids_ptr, sorted_ids_ptr, tile_experts_ptr, num_padded_ptr, num_pairs, num_tiles,
                  NUM_EXPERTS: tl.constexpr, PAIRS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                  TILES_PAD: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """`align_by_expert_ref` in one program for decode-sized batches: a [pairs, experts] one-hot, its column sums
    (counts) and column prefix sums (each pair's rank within its expert)."""
    wait_for_prior(PDL)
    pairs = tl.arange(0, PAIRS_PAD)
    is_pair = pairs < num_pairs
    experts = tl.load(ids_ptr + pairs, mask=is_pair, other=NUM_EXPERTS).to(tl.int32)
    onehot = (experts[:, None] == tl.arange(0, EXPERTS_PAD)[None, :]).to(tl.int32)  # [PAIRS_PAD, EXPERTS_PAD]
    counts = tl.sum(onehot, 0)
    padded_ends = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_starts = padded_ends - (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ranks = tl.cumsum(onehot, 0) - onehot  # earlier pairs of the same expert
    dest = tl.sum(onehot * (padded_starts[None, :] + ranks), 1)
    fill = tl.arange(0, BLOCK_M)
    for start in range(0, num_tiles * BLOCK_M, BLOCK_M):
        tl.store(sorted_ids_ptr + start + fill, tl.full([BLOCK_M], 0, tl.int32) + num_pairs)
    tl.debug_barrier()  # the padding is written before any pair id over it
    tl.store(sorted_ids_ptr + dest, pairs, mask=is_pair)
    tiles = tl.arange(0, TILES_PAD)
    ends_passed = (padded_ends[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32)  # [TILES_PAD, EXPERTS_PAD]
    tile_experts = tl.minimum(tl.sum(ends_passed, 1), NUM_EXPERTS - 1)
    tl.store(tile_experts_ptr + tiles, tile_experts, mask=tiles < num_tiles)
    tl.store(num_padded_ptr, tl.max(padded_ends, 0))


MAX_ALIGN_ONEHOT = 16384  # pairs x experts (padded) that the one-program alignment holds in registers


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pair ids sorted by expert, each expert's run padded to a multiple of block_m (padding = T * K).

    Returns sorted_ids int32 [num_tiles * block_m], tile_experts int32 [num_tiles], num_padded int32 [1] (rows in
    use), num_tiles from `_num_tiles`. No host sync. On a GPU, one kernel for decode-sized batches (a batch-1 step
    of a 32-layer model would otherwise run some 600 small torch kernels for it); three kernels beyond
    (`align_by_expert_chunks`)."""
    if use_triton(topk_ids):
        return aligner(topk_ids.numel(), num_experts)(topk_ids, num_experts, block_m)
    return align_by_expert_ref(topk_ids, num_experts, block_m)


def aligner(num_pairs: int, num_experts: int):
    """The Triton alignment for this many pairs: one program where its one-hot fits, else the chunked one."""
    return align_by_expert_triton if _fits_one_program(num_pairs, num_experts) else align_by_expert_chunks


def _fits_one_program(num_pairs: int, num_experts: int) -> bool:
    return next_power_of_2(num_pairs) * next_power_of_2(num_experts) <= MAX_ALIGN_ONEHOT


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Triton launcher of `align_by_expert` (one program; pairs x experts up to MAX_ALIGN_ONEHOT, padded)."""
    check_launchable(topk_ids)
    num_pairs, device = topk_ids.numel(), topk_ids.device
    if not _fits_one_program(num_pairs, num_experts):
        raise ValueError(f"{num_pairs} pairs x {num_experts} experts exceed the one-program alignment")
    pairs_pad, experts_pad = next_power_of_2(num_pairs), next_power_of_2(num_experts)
    num_tiles = _num_tiles(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(num_tiles * block_m, dtype=torch.int32, device=device)
    tile_experts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, tile_experts, num_padded, num_pairs, num_tiles,
                        NUM_EXPERTS=num_experts, PAIRS_PAD=pairs_pad, EXPERTS_PAD=experts_pad,
                        TILES_PAD=next_power_of_2(num_tiles), BLOCK_M=block_m,
                        **pdl_options(topk_ids.device),
                        num_warps=min(16, max(4, pairs_pad * experts_pad // 1024)))  # no spills on sm_90
    return sorted_ids, tile_experts, num_padded


ALIGN_CHUNK_ONEHOT = 8192  # pairs x experts (padded) of one chunk in the chunked alignment
ALIGN_SCAN_BLOCK = 4096  # chunks (or tiles) x experts (padded) the scan takes at once (8192 spilled for 8 experts)
ALIGN_FILL_BLOCK = 1024


@triton.jit(do_not_specialize=["num_pairs", "fill_len", "fill_span"])
def _align_count_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, num_pairs, fill_len, fill_span,
                        NUM_EXPERTS: tl.constexpr, CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                        FILL_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Chunk program_id(0)'s pairs counted by expert (counts [chunks, NUM_EXPERTS]); and its span of sorted_ids set
    to the padding id (the scatter kernel, launched after, writes the pairs over it)."""
    wait_for_prior(PDL)
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=NUM_EXPERTS).to(tl.int32)
    lanes = tl.arange(0, EXPERTS_PAD)
    counts = tl.sum((experts[:, None] == lanes[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + chunk * NUM_EXPERTS + lanes, counts, mask=lanes < NUM_EXPERTS)
    fill = tl.arange(0, FILL_BLOCK)
    fill_end = tl.minimum(fill_len, (chunk + 1) * fill_span)
    for start in range(chunk * fill_span, fill_end, FILL_BLOCK):
        tl.store(sorted_ids_ptr + start + fill, tl.full([FILL_BLOCK], 0, tl.int32) + num_pairs,
                 mask=start + fill < fill_end)


@triton.jit(do_not_specialize=["num_chunks", "num_tiles"])
def _align_scan_kernel(counts_ptr, tile_experts_ptr, num_padded_ptr, num_chunks, num_tiles,
                       NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNKS_AT_ONCE: tl.constexpr,
                       TILES_AT_ONCE: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """One program: each expert's total and padded run, then counts [chunks, experts] replaced in place by where
    each chunk's first pair of each expert goes (the run's start plus the earlier chunks' pairs of it), each tile's
    expert and the padded total."""
    wait_for_prior(PDL)
    lanes = tl.arange(0, EXPERTS_PAD)
    is_expert = lanes < NUM_EXPERTS
    rows = tl.arange(0, CHUNKS_AT_ONCE)
    total = tl.zeros([EXPERTS_PAD], tl.int32)
    for c0 in range(0, num_chunks, CHUNKS_AT_ONCE):
        mask = ((c0 + rows) < num_chunks)[:, None] & is_expert[None, :]
        total += tl.sum(tl.load(counts_ptr + (c0 + rows)[:, None] * NUM_EXPERTS + lanes[None, :], mask=mask,
                                other=0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, 0)
    running = padded_ends - padded
    for c0 in range(0, num_chunks, CHUNKS_AT_ONCE):
        mask = ((c0 + rows) < num_chunks)[:, None] & is_expert[None, :]
        ptrs = counts_ptr + (c0 + rows)[:, None] * NUM_EXPERTS + lanes[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, running[None, :] + tl.cumsum(counts, 0) - counts, mask=mask)
        running += tl.sum(counts, 0)
    tiles = tl.arange(0, TILES_AT_ONCE)
    for t0 in range(0, num_tiles, TILES_AT_ONCE):
        ends_passed = (padded_ends[None, :] <= (t0 + tiles)[:, None] * BLOCK_M).to(tl.int32)
        tl.store(tile_experts_ptr + t0 + tiles, tl.minimum(tl.sum(ends_passed, 1), NUM_EXPERTS - 1),
                 mask=t0 + tiles < num_tiles)
    tl.store(num_padded_ptr, tl.max(padded_ends, 0))


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(ids_ptr, base_ptr, sorted_ids_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
                          CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Chunk program_id(0)'s pairs written at their places: the chunk's base for their expert plus their rank among
    the chunk's pairs of that expert (pairs stay in order within an expert, as the reference's stable sort)."""
    wait_for_prior(PDL)
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    is_pair = pairs < num_pairs
    experts = tl.load(ids_ptr + pairs, mask=is_pair, other=NUM_EXPERTS).to(tl.int32)
    lanes = tl.arange(0, EXPERTS_PAD)
    onehot = (experts[:, None] == lanes[None, :]).to(tl.int32)
    base = tl.load(base_ptr + chunk * NUM_EXPERTS + lanes, mask=lanes < NUM_EXPERTS, other=0)
    dest = tl.sum(onehot * (base[None, :] + tl.cumsum(onehot, 0) - onehot), 1)
    tl.store(sorted_ids_ptr + dest, pairs, mask=is_pair)


def align_by_expert_chunks(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Triton launcher of `align_by_expert` for any batch: three kernels (count each chunk of pairs by expert and
    fill the padding; one program to place the runs and the chunks within them; scatter each chunk's pairs), where
    the reference runs some twenty torch kernels (a Qwen3-30B-A3B decode step of 256 requests, 2,048 pairs over
    128 experts, runs it in each of its 48 layers). The same outputs as the reference."""
    check_launchable(topk_ids)
    num_pairs, device = topk_ids.numel(), topk_ids.device
    experts_pad = next_power_of_2(num_experts)
    chunk = max(16, ALIGN_CHUNK_ONEHOT // experts_pad)
    num_chunks = max(1, cdiv(num_pairs, chunk))
    num_tiles = _num_tiles(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(num_tiles * block_m, dtype=torch.int32, device=device)
    tile_experts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    ids, pdl = topk_ids.reshape(-1), pdl_options(device)
    fill_len = num_tiles * block_m
    _align_count_kernel[(num_chunks,)](ids, counts, sorted_ids, num_pairs, fill_len, cdiv(fill_len, num_chunks),
                                       NUM_EXPERTS=num_experts, CHUNK=chunk, EXPERTS_PAD=experts_pad,
                                       FILL_BLOCK=ALIGN_FILL_BLOCK, **pdl, num_warps=4)
    _align_scan_kernel[(1,)](counts, tile_experts, num_padded, num_chunks, num_tiles, NUM_EXPERTS=num_experts,
                             EXPERTS_PAD=experts_pad, CHUNKS_AT_ONCE=max(1, ALIGN_SCAN_BLOCK // experts_pad),
                             TILES_AT_ONCE=max(1, ALIGN_SCAN_BLOCK // experts_pad), BLOCK_M=block_m, **pdl,
                             num_warps=4)
    _align_scatter_kernel[(num_chunks,)](ids, counts, sorted_ids, num_pairs, NUM_EXPERTS=num_experts, CHUNK=chunk,
                                         EXPERTS_PAD=experts_pad, **pdl, num_warps=4)
    return sorted_ids, tile_experts, num_padded


def _expert_counts(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts]: the pairs of each expert, on the device (torch.bincount syncs with the host)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Torch reference of `align_by_expert` (and its implementation on CPU)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    num_tiles = _num_tiles(num_pairs, num_experts, block_m)
    experts = topk_ids.reshape(-1).long()
    counts = _expert_counts(experts, num_experts)
    padded_ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    order = torch.argsort(experts, stable=True)  # pair ids, grouped by expert
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_starts[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, tile_experts.to(torch.int32), padded_ends[-1:].to(torch.int32)


# num_pairs (T * K) changes with every step's batch: specializing on it (Triton specializes integers that are
# multiples of 16) would compile new variants while requests wait.
@triton.jit
def store_pair_rows(acc, acc_up, out_ptr, routing_ptr, pairs, row_mask, offs_n, n_mask, stride_o, GATED: tl.constexpr,
                    WEIGHTED: tl.constexpr):
    """A grouped GEMM tile's epilogue: its (token, expert) pairs' rows rounded to out's dtype (GATED: silu(gate) * up,
    each step rounded as transformers rounds it), times their routing weights when WEIGHTED, stored at the pairs."""
    dtype = out_ptr.dtype.element_ty
    if GATED:
        out = silu_mul_rounded(acc, acc_up, dtype)
    else:
        out = acc.to(dtype)
    if WEIGHTED:
        routing = tl.load(routing_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * routing[:, None]).to(dtype)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_o + offs_n[None, :], out,
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def grouped_tile(num_tiles, num_n_blocks, GROUP_M: tl.constexpr):
    """(tile of pairs, n-block) of this program: GROUP_M tiles at a time, each group walked over every n-block with
    its tiles fastest (GROUP_M 1: a tile's n-blocks one after another). The programs running at once then share
    each weight tile (read from memory once a group, from the L2 by the group's other tiles), where tile after tile
    each read every weight of its expert again: a Mixtral layer at 4,096 tokens (16 tiles an expert) moved ~45 GB,
    10.5 ms at copy speed, the 11 ms its GEMMs took (263 TFLOP/s)."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n_blocks
    first = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_tiles - first, GROUP_M)
    local = pid % per_group
    return first + local % rows, local // rows


@triton.jit(do_not_specialize=["num_pairs", "num_tiles"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, routing_ptr, sorted_ids_ptr, tile_experts_ptr, num_padded_ptr,
    N, K, num_pairs, num_tiles, stride_a, stride_we, stride_wn, stride_o,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """out[pair, n-block] for one tile of pairs (`grouped_tile`); a row of `a` is pair // ROWS_PER_A (x: K slots
    share a token). GATED: w holds [gate rows (N) ; up rows (N)] and out = silu(gate) * up; WEIGHTED: out *=
    routing[pair]."""
    wait_for_prior(PDL)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    tile, n_block = grouped_tile(num_tiles, num_n_blocks, GROUP_M)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    offs_n = (n_block * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    acc, acc_up = rows_times_weight(a_ptr, a_rows, row_mask, stride_a, w_ptr + expert * stride_we, offs_n, n_mask,
                                    stride_wn, N, K, GATED, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_pair_rows(acc, acc_up, out_ptr, routing_ptr, pairs, row_mask, offs_n, n_mask, stride_o, GATED, WEIGHTED)


def _check_inputs(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if hidden != x.shape[1] or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         "expected w13 [E, 2I, H], w2 [E, H, I]")
    check_dtype("x", x, FLOAT_DTYPES)
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"expert weights {w13.dtype}/{w2.dtype} must have x's dtype {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [T={x.shape[0]}, top_k], got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)}")
    check_dtype("topk_ids", topk_ids, (torch.int64, torch.int32))
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)


# Tiles of pairs a group of programs walks together (`grouped_tile`), reasoned from the weight traffic (above). H100,
# Mixtral's layer (`python -m benchmarks.kernels --only moe --tune --cuda-graph`, h100-kernels-tune-moe-grouped.json):
# never slower than GROUP_M=1 (the order before), 512 / 4,096 rows 1.40 / 9.32 ms against 1.88 / 14.83; 16 within 2%
GROUP_M = 8


@functools.lru_cache(maxsize=None)
def moe_config(num_pairs: int, num_experts: int, out_features: int, gated: bool, dtype: torch.dtype,
               device: torch.device) -> dict:
    """Tile sizes: BLOCK_M from the rows an expert gets on average: 16 (tl.dot's least) up to 16 of them, decode
    batches, where each program streams a weight tile as kernels/linear's decode kernel does; else 64, where the
    GEMMs turn compute-bound. Two values only, so that few variants compile. BLOCK_K and the stages shrink until
    the tiles fit in shared memory. The 64-row tiles are 128 wide: H100, Mixtral's layer (`python -m
    benchmarks.kernels --only moe --tune --cuda-graph`, h100-kernels-tune-moe-grouped.json), 4,096 rows 7.85 ms
    against 9.32 with 64-wide tiles, 512 rows 1.34 against 1.40."""
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    block_n = 128 if block_m >= 64 else 64 if out_features >= 2048 else 32
    block_k = 64 if block_m >= 64 else 128
    if dtype == torch.float32:
        block_n, block_k = min(block_n, 32), 32
    stages = 3 if block_m >= 64 or gated else 4
    size, limit = dtype.itemsize, shared_memory_per_block(device)
    while stages * (block_m + block_n * (2 if gated else 1)) * block_k * size > limit and (stages > 2 or block_k > 32):
        if stages > 2:
            stages -= 1
        else:
            block_k //= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": GROUP_M, "num_warps": 4,
            "num_stages": stages}


def _grouped_gemm(a, w, out, aligned, rows_per_a: int, gated: bool, cfg: dict, routing=None) -> None:
    """One launch: out[pair] = a[pair // rows_per_a] @ w[expert of the pair's tile].T (gated: silu-and-mul;
    routing: times routing[pair])."""
    sorted_ids, tile_experts, num_padded = aligned
    n = w.shape[1] // 2 if gated else w.shape[1]
    num_tiles = tile_experts.shape[0]
    _moe_gemm_kernel[(num_tiles * cdiv(n, cfg["BLOCK_N"]),)](
        a, w, out, out if routing is None else routing, sorted_ids, tile_experts, num_padded,
        n, w.shape[2], out.shape[0], num_tiles, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, GATED=gated, WEIGHTED=routing is not None, UPCAST=upcast_dot_operands(a.dtype, a.device),
        PRECISION=dot_precision(a.dtype), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], **pdl_options(a.device), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids, config: dict | None = None):
    """Triton launcher of `fused_moe`: the expert alignment (one kernel for decode-sized batches), two grouped-GEMM
    launches (gate/up + SiLU-and-mul, down + routing weight), then the slots' sum. config overrides `moe_config`'s
    keys for both GEMMs (tuning)."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    check_launchable(x, w13, w2, topk_weights, topk_ids)
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(name, t)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter, hidden = w13.shape[0], w2.shape[2], x.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg_up = {**moe_config(num_pairs, num_experts, inter, True, x.dtype, x.device), **(config or {})}
    cfg_down = {**moe_config(num_pairs, num_experts, hidden, False, x.dtype, x.device), **(config or {})}
    if cfg_down["BLOCK_M"] != cfg_up["BLOCK_M"]:
        raise ValueError("both GEMMs must use one BLOCK_M: they share the expert alignment")
    aligned = aligner(num_pairs, num_experts)(topk_ids, num_experts, cfg_up["BLOCK_M"])
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, aligned, top_k, True, cfg_up)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(h, w2, out, aligned, 1, False, cfg_down, routing=topk_weights.reshape(-1).contiguous())
    return out.view(num_tokens, top_k, hidden).sum(dim=1) if top_k > 1 else out


def fused_moe_grouped_mm(x, w13, w2, topk_weights, topk_ids):
    """`fused_moe` through torch._grouped_mm (CUTLASS's grouped GEMMs on sm_90, a loop elsewhere): the pairs sorted
    by expert (a stable argsort, no padding), x's rows gathered in that order, gate/up as one grouped GEMM over the
    experts' row ranges (offs: each expert's end, on the device: no host sync), SiLU-and-mul, down as a second one,
    then each pair's row times its routing weight put back in pair order and the slots summed. Rounded as
    `fused_moe_triton` rounds (gate / up, silu, the product, down, then the weight once). Three passes over the
    pairs' rows more than the fused kernel (the gather, the activation, the put-back), for a GEMM library's tiles."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = _expert_counts(flat, w13.shape[0]).cumsum(0).to(torch.int32)
    rows = x.index_select(0, order // top_k)
    h = silu_and_mul(torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends))
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)
    y = (y.float() * topk_weights.reshape(-1)[order].float()[:, None]).to(x.dtype)
    out = torch.empty_like(y).index_copy_(0, order, y)
    return out.view(num_tokens, top_k, -1).sum(dim=1) if top_k > 1 else out


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids):
    """Torch reference of `fused_moe` (and its CPU implementation): transformers' loop over the chosen experts."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    return experts_loop_ref(x, lambda expert: (w13[expert], w2[expert]), w13.shape[0], topk_weights, topk_ids)


def experts_loop_ref(x, expert_weights, num_experts: int, topk_weights, topk_ids, linears=(F.linear, F.linear)):
    """transformers' loop over the experts some token chose: `expert_weights(e)` -> (w13 [2I, H], w2 [H, I]) in
    x's dtype (kernels/moe_quant.py's reference dequantizes them there, and only for the experts in use);
    `linears`: up's and down's linear(a, w) -> a @ w.T in a's dtype (kernels/moe_quant.py's FP8 ones quantize a
    first)."""
    out = torch.zeros_like(x)
    for expert in range(num_experts):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        w13, w2 = expert_weights(expert)
        gate, up = linears[0](x[tokens], w13).chunk(2, dim=-1)
        y = linears[1](F.silu(gate) * up, w2) * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    """x [T, H]; w13 [E, 2I, H] ([gate ; up] rows per expert); w2 [E, H, I]; topk_weights (float, any dtype) and
    topk_ids [T, K] -> [T, H] in x's dtype: sum over k of topk_weights[t, k] * expert topk_ids[t, k]'s SiLU MLP."""
    if use_triton(x):
        if takes_grouped_mm(x, w2, topk_ids.numel()):
            return fused_moe_grouped_mm(x, w13, w2, topk_weights, topk_ids)
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


# Where torch._grouped_mm beat the Triton grouped GEMMs (H100, `python -m benchmarks.kernels --only moe --cuda-graph
# [--moe-shape qwen3-30b-a3b]`, benchmarks/results/h100-kernels-moe-grouped-mm-{mixtral,qwen3}.json): Mixtral's
# layer (8 experts of 14,336 x 4,096) from 1,024 tokens (256 pairs an expert: 1.23x) to 8,192 (1.40x; 0.97x at
# 512); Qwen3-30B-A3B's small experts (128 of 768 x 2,048) at no size up to 8,192 tokens (0.61-0.67x).
GROUPED_MM_PAIRS_PER_EXPERT = 256
GROUPED_MM_MIN_INTER = 4096


def takes_grouped_mm(x: torch.Tensor, w2: torch.Tensor, num_pairs: int) -> bool:
    """Whether `fused_moe` runs the layer through torch._grouped_mm: bf16 on sm_90 (where it was measured), large
    experts (this rank's intermediate size) and enough pairs an expert for the GEMM library's tiles."""
    num_experts, _, inter = w2.shape
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] == 9 and inter >= GROUPED_MM_MIN_INTER
            and num_pairs >= GROUPED_MM_PAIRS_PER_EXPERT * num_experts)
