"""The host KV tier in the block manager: write-through of committed blocks, prefixes continued on the host and
copied back, LRU eviction, and the rules that let a step's offloads run beside it."""

import pytest

from engine.block_manager import BlockManager
from engine.config import CacheConfig
from engine.errors import ParamError
from engine.onload_cost import NEVER_ONLOAD, OnloadCost
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.engine.test_block_manager import admit_computed, make_req
from tests.engine.test_engine_stress import run_and_compare_with_each_alone
from tests.engines import llm_engine


def evict_the_device_cache(bm: BlockManager) -> None:
    """Takes every device block for a request that is never committed (its blocks are not cached) and frees it."""
    filler = make_req("filler", range(10_000, 10_000 + bm.num_blocks * bm.block_size))
    assert bm.admit(filler, filler.num_tokens) is not None
    bm.take_transfers()
    bm.free(filler)


def test_committed_blocks_are_written_to_the_host_once():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=8)
    req = make_req("a", range(13))  # 3 full blocks
    allocation = admit_computed(bm, req)
    offloads, copies, onloads = bm.take_transfers()
    assert [device for device, _ in offloads] == allocation.block_ids[:3] and copies == onloads == []
    assert len({host for _, host in offloads}) == 3 and bm.num_offloaded_blocks == 3
    bm.free(req)
    again = make_req("b", range(13))
    admit_computed(bm, again)  # the device cache has them: no second copy
    assert bm.take_transfers() == ([], [], []) and bm.prefix_hits_tokens == 12
    bm.check_integrity()


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host():
    bm = BlockManager(num_blocks=5, block_size=4, num_host_blocks=8)
    first = make_req("a", range(13))
    admit_computed(bm, first)
    offloaded = dict(bm.take_transfers()[0])
    bm.free(first)
    evict_the_device_cache(bm)
    again = make_req("a2", range(13))
    allocation = bm.admit(again, 13)
    assert (allocation.num_computed_tokens, allocation.num_new_tokens) == (12, 1)
    offloads, _, onloads = bm.take_transfers()
    assert offloads == [] and [device for _, device in onloads] == allocation.block_ids[:3]
    assert [host for host, _ in onloads] == [offloaded[b] for b in sorted(offloaded, key=list(offloaded).index)]
    assert (bm.prefix_hits_tokens, bm.host_hits_tokens, bm.num_onloaded_blocks) == (0, 12, 3)
    bm.check_integrity()
    # the copied-back blocks are device cache entries again: a third request hits them on the device
    third = make_req("a3", range(13))
    assert bm.admit(third, 13).block_ids[:3] == allocation.block_ids[:3]
    bm.check_integrity()


def test_a_block_the_next_step_offloads_is_not_the_one_it_writes():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=8)
    first = make_req("a", range(9))  # blocks 0, 1 full and offloaded by the next step; block 2 partly filled
    first_blocks = admit_computed(bm, first).block_ids
    bm.free(first)
    # Without the rule the LRU order would hand out a's tail first, then its full blocks: the other request gets
    # the free blocks without a pending offload first.
    second = make_req("b", range(100, 104))
    taken = bm.admit(second, 4).block_ids
    assert not set(taken) & set(first_blocks[:2])
    # then the partly filled one, then only offloading blocks are left: one offload is dropped, and the host forgets
    # that block's hash
    third = make_req("c", range(200, 208))
    third_blocks = bm.admit(third, 8).block_ids
    offloads, _, _ = bm.take_transfers()
    assert len(offloads) == 1 and offloads[0][0] not in third_blocks and len(bm._host_cached) == 1
    bm.check_integrity()


def test_the_host_evicts_its_least_recently_used_block():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=2)
    for i in range(3):  # three one-block prompts, one step each
        req = make_req(f"r{i}", range(10 * i, 10 * i + 5))
        admit_computed(bm, req)
        bm.take_transfers()
        bm.free(req)
    assert bm.host_usage == 1.0 and bm.num_offloaded_blocks == 3
    evict_the_device_cache(bm)  # the host holds the last two
    hits = [bm.admit(make_req(f"q{i}", range(10 * i, 10 * i + 5)), 5).num_computed_tokens for i in range(3)]
    assert hits == [0, 4, 4]
    assert len(bm.take_transfers()[2]) == 2
    bm.check_integrity()


def test_a_host_block_the_step_reads_is_not_overwritten_by_it():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=1)
    a = make_req("a", range(5))
    admit_computed(bm, a)
    bm.take_transfers()
    bm.free(a)
    evict_the_device_cache(bm)  # the one host block holds a's
    back = bm.admit(make_req("a2", range(5)), 5)  # copied back from the host in the next step
    assert back.num_computed_tokens == 4
    b = make_req("b", range(50, 55))
    admit_computed(bm, b)  # its block would need the one host block, which the step reads: no copy
    offloads, _, onloads = bm.take_transfers()
    assert offloads == [] and len(onloads) == 1
    bm.check_integrity()


def _host_only_prefix(bm: BlockManager, tokens) -> None:
    """Computes a prompt of `tokens` (written through to the host), then leaves it on the host only."""
    first = make_req("first", tokens)
    admit_computed(bm, first)
    bm.take_transfers()
    bm.free(first)
    evict_the_device_cache(bm)


@pytest.mark.parametrize("min_onload_blocks, onloaded", [(1, True), (3, True), (4, False), (NEVER_ONLOAD, False)])
def test_a_host_continuation_shorter_than_the_threshold_is_computed_again(min_onload_blocks, onloaded):
    bm = BlockManager(num_blocks=6, block_size=4, num_host_blocks=8, min_onload_blocks=min_onload_blocks)
    _host_only_prefix(bm, range(13))  # 3 full blocks on the host
    allocation = bm.admit(make_req("again", range(13)), 13)
    _, _, onloads = bm.take_transfers()
    if onloaded:
        assert (allocation.num_computed_tokens, allocation.num_new_tokens, len(onloads)) == (12, 1, 3)
        assert allocation.num_onloaded_blocks == 3 and bm.host_hits_tokens == 12
    else:  # all 13 tokens computed: no copy, no host hit counted
        assert (allocation.num_computed_tokens, allocation.num_new_tokens, onloads) == (0, 13, [])
        assert allocation.num_onloaded_blocks == 0 and bm.host_hits_tokens == 0
    assert bm.host_queries_tokens == 13 + 13 + bm.num_blocks * bm.block_size  # first, filler, again
    bm.check_integrity()


def test_the_threshold_counts_only_the_blocks_found_on_the_host():
    """Device hits first, then the host's continuation: only the continuation is weighed."""
    bm = BlockManager(num_blocks=6, block_size=4, num_host_blocks=8, min_onload_blocks=2)
    _host_only_prefix(bm, range(13))
    admit_computed(bm, make_req("head", range(5)))  # block 0 back on the device (copied back? 1 block < 2: computed)
    assert bm.take_transfers()[2] == []
    allocation = bm.admit(make_req("again", range(13)), 13)
    _, _, onloads = bm.take_transfers()
    assert allocation.num_computed_tokens == 12 and len(onloads) == 2  # 1 device hit + 2 host blocks copied back
    bm.check_integrity()


def test_the_cost_model_onloads_from_where_copying_is_cheaper():
    cost = OnloadCost(onload_bytes_per_s=1e9, onload_latency_s=4.6e-3, prefill_tokens_per_s=1e4)
    # a block: 16 tokens computed in 1.6 ms, or 100 kB copied in 0.1 ms after 4.6 ms: from 4 blocks on (4.6 / 1.5)
    n = cost.min_onload_blocks(block_size=16, block_bytes_per_rank=100_000)
    assert n == 4
    assert cost.onload_s(n, 100_000) <= cost.recompute_s(n, 16)
    assert cost.onload_s(n - 1, 100_000) > cost.recompute_s(n - 1, 16)
    assert OnloadCost(1e9, 0.0, 1e4).min_onload_blocks(16, 100_000) == 1
    assert OnloadCost(1e9, 0.0, 1e4).min_onload_blocks(16, 1_600_000) == NEVER_ONLOAD  # copying costs as much


@pytest.mark.parametrize("name, value", [("onload_gb_per_s", 0.0), ("prefill_tokens_per_s", -1.0),
                                         ("onload_latency_s", -1e-3), ("min_onload_blocks", 0)])
def test_bad_cost_model_values_are_refused_naming_the_field(name, value):
    with pytest.raises(ParamError, match=name):
        CacheConfig(**{name: value})


def test_a_preempted_request_counts_what_it_gets_back_and_what_it_computes_again():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=8)
    req = make_req("p", range(14))  # 3 full blocks and 2 tokens
    admit_computed(bm, req)
    bm.take_transfers()
    bm.preempt(req)
    req.status, req.num_preempted_tokens, req.num_computed_tokens = RequestStatus.PREEMPTED, 14, 0
    assert bm.swapped_out_tokens == 12
    evict_the_device_cache(bm)
    queries = bm.prefix_queries_tokens
    allocation = bm.admit(req, 14)
    assert allocation.num_onloaded_blocks == 3
    assert (bm.swapped_in_tokens, bm.preemption_recomputed_tokens) == (12, 2)
    assert bm.prefix_queries_tokens == queries  # a resumption is not a new request's lookup (as vLLM counts)
    bm.take_transfers()
    bm.check_integrity()


# ---- write-back (kv_offload_policy "write-back"): copies made when the device cache is about to reuse a block --------
def test_write_back_copies_nothing_while_the_device_pool_has_room():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=8, write_back=True, write_back_ahead=2)
    req = make_req("a", range(13))
    admit_computed(bm, req)
    assert bm.take_transfers() == ([], [], [])
    bm.free(req)  # its blocks go behind the never-used ones: the next two to be reused have no KV to keep
    assert bm.take_transfers() == ([], [], []) and bm.num_offloaded_blocks == 0
    bm.check_integrity()


def test_write_back_copies_the_blocks_next_in_line_and_an_evicted_prefix_comes_back():
    bm = BlockManager(num_blocks=5, block_size=4, num_host_blocks=8, write_back=True, write_back_ahead=5)
    first = make_req("a", range(13))
    first_blocks = admit_computed(bm, first).block_ids
    assert bm.take_transfers()[0] == []  # committed, not copied
    bm.free(first)
    offloads, _, _ = bm.take_transfers()  # a step: its three cached blocks are next in line, copied beside it
    assert sorted(device for device, _ in offloads) == sorted(first_blocks[:3]) and bm.num_offloaded_blocks == 3
    evict_the_device_cache(bm)  # every block reused: none waits for a copy, none is dropped
    again = make_req("a2", range(13))
    allocation = bm.admit(again, 13)
    assert (allocation.num_computed_tokens, bm.host_hits_tokens) == (12, 12)
    assert len(bm.take_transfers()[2]) == 3
    bm.check_integrity()


def test_write_back_passes_over_a_block_it_has_not_copied_yet():
    """Reached before its copy (nothing copied ahead), a cached block is copied by the next step and passed over in
    this one; when only such blocks are left, the last one's copy is dropped and it is reused."""
    bm = BlockManager(num_blocks=5, block_size=4, num_host_blocks=8, write_back=True)
    first = make_req("a", range(13))
    first_blocks = admit_computed(bm, first).block_ids
    bm.take_transfers()
    bm.free(first)  # LRU: the never-used block, a's partial block, then its full blocks from the last
    taken = bm.admit(make_req("b", range(100, 112)), 12).block_ids
    offloads, _, _ = bm.take_transfers()
    assert sorted(taken) == sorted([4, first_blocks[3], first_blocks[0]])
    assert sorted(device for device, _ in offloads) == sorted(first_blocks[1:3]) and len(bm._host_cached) == 2
    bm.check_integrity()


def test_the_offload_policy_is_checked_and_reaches_the_block_manager(tiny_model_dir):
    with pytest.raises(ParamError, match="kv_offload_policy"):
        CacheConfig(kv_offload_policy="write-around")
    engine = llm_engine(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=24, num_host_kv_blocks=8,
                        kv_offload_policy="write-back", max_num_batched_tokens=32, max_num_seqs=4)
    assert engine.block_manager.write_back and engine.block_manager.write_back_ahead == 32 // 4 + 4
    engine.shutdown()


def test_the_host_tier_needs_prefix_caching():
    with pytest.raises(ParamError, match="prefix caching"):
        CacheConfig(enable_prefix_caching=False, swap_space_gib=4)
    with pytest.raises(ParamError, match="swap_space"):
        CacheConfig(swap_space_gib=-1)


@pytest.mark.parametrize("flag", ["--swap-space", "--kv-offload-gib"])
def test_the_flag_reaches_the_serve_apps_engine_args(flag):
    from cluster.app import parse_args
    from deploy.cli import build_parser, serve_app_args

    argv = ["serve", "--model", "tiny", flag, "2.5", "--kv-offload-policy", "write-back"]
    app_args = serve_app_args(build_parser().parse_args(argv))
    assert app_args["models"][0]["swap_space"] == 2.5
    assert app_args["models"][0]["kv_offload_policy"] == "write-back"
    engine = parse_args(app_args).models[0].engine
    assert engine.swap_space == 2.5 and engine._parts()[0].swap_space_gib == 2.5
    assert engine._parts()[0].kv_offload_policy == "write-back"


# ---- an engine with a host tier (the tiny model on CPU: the worker's copies are real, the streams are not) --------
def _greedy(engine, req_id: str, prompt: list[int]) -> tuple[list[int], list]:
    """The greedy tokens and their logprobs (top 2)."""
    engine.add_request(req_id, {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2), stream=False)
    out = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out = delta
    seq = out.seqs[0]
    return seq.token_ids, [(entry.logprob, [(t, v) for t, _, v in entry.top]) for entry in seq.logprobs]


def _assert_same(out, reference, atol: float = 1e-5) -> None:
    """The same tokens and top-2 ids, logprobs within atol: a prompt whose prefix came from the host is computed
    over its last block only, which a CPU's matmul may round differently from the whole prompt's (seen at 1e-6)."""
    (tokens, logprobs), (ref_tokens, ref_logprobs) = out, reference
    assert tokens == ref_tokens
    for (lp, top), (ref_lp, ref_top) in zip(logprobs, ref_logprobs, strict=True):
        assert lp == pytest.approx(ref_lp, abs=atol)
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=atol)


# (engine args, the threshold they give): copy back (a prefill so slow that one block's copy pays), or compute
# again (a threshold past the prefix's 9 blocks, or a prefill so fast that no copy pays)
ONLOAD = ({"prefill_tokens_per_s": 1.0}, 1)
RECOMPUTE, RECOMPUTE_BY_COST = ({"min_onload_blocks": 10}, 10), ({"prefill_tokens_per_s": 1e15}, NEVER_ONLOAD)


WRITE_BACK = ({"prefill_tokens_per_s": 1.0, "kv_offload_policy": "write-back"}, 1)


@pytest.mark.parametrize("model, kv_cache_dtype, choice", [
    ("tiny", "auto", ONLOAD), ("tiny", "fp8", ONLOAD), ("smollm2", "auto", ONLOAD), ("tiny", "auto", RECOMPUTE),
    ("tiny", "fp8", RECOMPUTE_BY_COST), ("smollm2", "auto", RECOMPUTE_BY_COST), ("tiny", "fp8", WRITE_BACK)],
    ids=["tiny", "tiny-fp8", "smollm2", "tiny-recompute", "tiny-fp8-recompute-by-cost", "smollm2-recompute-by-cost",
         "tiny-fp8-write-back"])
def test_an_evicted_prefix_comes_back_from_the_host_with_the_same_tokens(tiny_model_dir, real_model_dir, model,
                                                                         kv_cache_dtype, choice):
    """Tokens and logprobs equal to an engine without the tier's (whose KV is computed): the tiny model, FP8 KV,
    and the built-in SmolLM2 (float32); copied back or, where the cost model says so, computed again; the blocks
    written to the host as they are computed, or (write-back) as the device pool reuses them."""
    prompt = list(range(1, 41))  # 10 blocks of 4
    others = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(3)]
    small = dict(model=tiny_model_dir if model == "tiny" else real_model_dir, dtype="float32", device="cpu",
                 block_size=4, num_kv_blocks=24, kv_cache_dtype=kv_cache_dtype)
    reference = _greedy(llm_engine(**small, enable_prefix_caching=False), "ref", prompt)
    engine = llm_engine(**small, num_host_kv_blocks=64, **choice[0])
    assert engine.executor.num_host_kv_blocks == 64
    bm = engine.block_manager
    assert bm.min_onload_blocks == choice[1]
    _assert_same(_greedy(engine, "first", prompt), reference)
    for i, other in enumerate(others):  # 120 more tokens through a 96-token pool: the prompt's blocks are evicted
        _greedy(engine, f"other{i}", other)
    if choice is WRITE_BACK:  # the prompt's 10 full blocks were copied as they were about to be reused
        assert 10 <= bm.num_offloaded_blocks < 10 + 3 * 9
    else:  # every full block, as it was computed
        assert bm.num_offloaded_blocks >= 10 + 3 * 9
    onloaded_before = bm.num_onloaded_blocks
    _assert_same(_greedy(engine, "again", prompt), reference)
    stats = engine.get_stats()
    block_bytes = engine.executor.kv_block_bytes
    assert block_bytes == engine.executor.worker.block_bytes > 0
    assert stats.kv_onloaded_bytes == bm.num_onloaded_blocks * block_bytes
    assert stats.host_prefix_cache_queries == stats.prefix_cache_queries == 5 * 40
    if choice is not RECOMPUTE and choice is not RECOMPUTE_BY_COST:  # all but the block with the last token
        assert stats.host_prefix_cache_hits == 36 and bm.num_onloaded_blocks - onloaded_before == 9
    else:
        assert stats.host_prefix_cache_hits == 0 and bm.num_onloaded_blocks == onloaded_before == 0
    engine.step()
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("overlap, policy", [(True, "write-through"), (False, "write-through"), (True, "write-back")],
                         ids=["overlapped", "synchronous", "write-back"])
def test_preempted_requests_resume_from_the_host_with_the_same_tokens(tiny_model_dir, overlap, policy):
    engine = llm_engine(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=40,
                        max_num_batched_tokens=24, max_num_seqs=6, num_host_kv_blocks=256, kv_offload_policy=policy)
    run_and_compare_with_each_alone(engine, tiny_model_dir, seed=3, overlap=overlap)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.swapped_in_tokens > 0
    # the host held blocks of a request when it was preempted: written through; write-back copies them after, as the
    # pool reuses them, and they come back all the same
    assert (stats.swapped_out_tokens > 0) == (policy == "write-through")
    assert engine.block_manager.num_onloaded_blocks > 0
