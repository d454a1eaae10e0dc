"""Scheduler driven with hand-made ModelRunnerOutputs, where a GPU would be."""

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens_per_step, 1024), bm)


def make_req(req_id, num_prompt, max_tokens=4, **kw):
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(req_id, [(7 * i + len(req_id)) % 50 for i in range(num_prompt)], params, max_tokens)


def fake_step(s: Scheduler):
    """Samples token 1 for each request whose scheduled tokens reach its end, as the worker would."""
    out = s.schedule()
    result = ModelRunnerOutput()
    for req_id in out.num_scheduled_tokens:
        req = s.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(1)
            result.logprobs.append(None)
    s.update_from_output(out, result)
    s.block_manager.check_integrity()
    return out


def run_all(s, max_steps=500):
    outs = []
    for _ in range(max_steps):
        if not s.requests:
            return outs
        outs.append(fake_step(s))
    raise AssertionError("did not finish")


def test_decodes_first_then_prefill_chunks_under_budget():
    s = make_scheduler(max_tokens_per_step=10)
    s.add_request(make_req("a", 3, max_tokens=5))
    first = fake_step(s)
    assert first.num_scheduled_tokens == {"a": 3}
    s.add_request(make_req("b", 25))
    second = fake_step(s)
    assert list(second.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]  # decode first, then a chunk
    assert second.cached_reqs[0].req_id == "a" and second.new_reqs[0].req_id == "b"
    third = fake_step(s)
    assert third.num_scheduled_tokens == {"a": 1, "b": 9}
    assert third.new_reqs == []  # b crossed the boundary once; now only diffs
    run_all(s)
    assert s.block_manager.num_free_blocks == 64


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_req(f"r{i}", 4))
    out = fake_step(s)
    assert len(out.num_scheduled_tokens) == 2 and s.num_waiting == 2
    run_all(s)


def test_preemption_frees_the_newest_and_recomputes():
    s = make_scheduler(num_blocks=6, block_size=4, max_tokens_per_step=64)
    s.add_request(make_req("old", 8, max_tokens=12))
    s.add_request(make_req("new", 8, max_tokens=12))
    fake_step(s)  # both prefilled: 4 blocks used
    preempted = []
    for _ in range(40):
        if not s.requests:
            break
        out = fake_step(s)
        preempted += out.preempted_req_ids
    assert preempted and set(preempted) == {"new"}
    assert not s.requests
    assert s.num_preemptions >= 1
    assert s.block_manager.num_free_blocks == 6


def test_resumed_request_is_sent_again_with_its_outputs():
    s = make_scheduler(num_blocks=5, block_size=4)
    s.add_request(make_req("a", 8, max_tokens=8))
    s.add_request(make_req("b", 8, max_tokens=8))
    resumed = None
    for _ in range(60):
        out = fake_step(s)
        for new in out.new_reqs:
            if new.output_token_ids:
                resumed = new
        if not s.requests:
            break
    assert resumed is not None and resumed.output_token_ids == [1] * len(resumed.output_token_ids)


def test_prefix_hit_skips_computed_tokens():
    s = make_scheduler(block_size=4)
    a = make_req("a", 13)
    s.add_request(a)
    run_all(s)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=2), 2)
    s.add_request(b)
    out = fake_step(s)
    assert out.new_reqs[0].num_computed_tokens == 12 and out.num_scheduled_tokens == {"b": 1}
    assert b.num_cached_tokens == 12
    run_all(s)


def test_n_siblings_share_the_leaders_prompt_blocks():
    s = make_scheduler(block_size=4)
    params = SamplingParams(n=3, max_tokens=3)
    leader = Request("p#0", list(range(10)), params, 3, parent_id="p")
    sibs = [Request(f"p#{i}", list(range(10)), params, 3, parent_id="p", index=i, leader=leader)
            for i in (1, 2)]
    for r in [leader] + sibs:
        s.add_request(r)
    first = fake_step(s)
    assert list(first.num_scheduled_tokens) == ["p#0"]  # siblings wait for the leader's prompt
    second = fake_step(s)
    new = {r.req_id: r for r in second.new_reqs}
    assert set(new) == {"p#1", "p#2"}
    assert all(r.num_computed_tokens == 9 for r in new.values())
    assert second.num_scheduled_tokens["p#1"] == 1
    # blocks 0, 1 shared by all three; block 2 (positions 8, 9) partly filled: copied on write
    leader_blocks = first.new_reqs[0].block_ids
    assert all(r.block_ids[:2] == leader_blocks[:2] for r in new.values())
    assert len({leader_blocks[2], new["p#1"].block_ids[2], new["p#2"].block_ids[2]}) == 3
    assert sorted(second.block_copies) == sorted((leader_blocks[2], r.block_ids[2]) for r in new.values())
    run_all(s)
    assert s.block_manager.num_free_blocks == 64


def test_n_siblings_of_a_one_token_prompt_share_nothing_and_compute_it_themselves():
    """A one-token prompt (an empty text prompt is just BOS) has nothing computed to share: each sibling starts
    like a request of its own (the fork assertion killed the engine: found by the HTTP fuzzing test)."""
    s = make_scheduler(block_size=4)
    params = SamplingParams(n=2, max_tokens=3)
    leader = Request("p#0", [0], params, 3, parent_id="p")
    sib = Request("p#1", [0], params, 3, parent_id="p", index=1, leader=leader)
    for r in (leader, sib):
        s.add_request(r)
    first = fake_step(s)
    assert {r.req_id: r.num_computed_tokens for r in first.new_reqs} == {"p#0": 0, "p#1": 0}
    assert first.num_scheduled_tokens == {"p#0": 1, "p#1": 1}
    run_all(s)
    assert leader.output_token_ids == sib.output_token_ids == [1, 1, 1]
    assert s.block_manager.num_free_blocks == 64


def test_finish_and_abort_free_blocks_and_tell_workers():
    s = make_scheduler()
    s.add_request(make_req("a", 6, max_tokens=50))
    s.add_request(make_req("w", 6))
    fake_step(s)
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert "a" in out.finished_req_ids
    s.finish_request("w", RequestStatus.FINISHED_ABORTED)
    assert not s.requests


def test_stop_token_and_length():
    s = make_scheduler()
    req = make_req("a", 4, max_tokens=10)
    req.sampling_params.all_stop_token_ids = (1,)
    s.add_request(req)
    run_all(s)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [1]
    req2 = make_req("b", 4, max_tokens=3)
    s.add_request(req2)
    run_all(s)
    assert req2.status == RequestStatus.FINISHED_LENGTH and len(req2.output_token_ids) == 3


def test_min_tokens_defers_stop():
    s = make_scheduler()
    req = make_req("a", 4, max_tokens=10, min_tokens=3)
    req.sampling_params.all_stop_token_ids = (1,)
    s.add_request(req)
    run_all(s)
    assert len(req.output_token_ids) == 3


def overlapped_run(s: Scheduler, max_steps=500):
    """Schedules step N+1 before step N's tokens come back, as the engine does with overlap."""
    pending = None
    for _ in range(max_steps):
        if not s.requests and pending is None:
            return
        out = s.schedule()
        samplers = []
        for req_id in out.num_scheduled_tokens:
            req = s.requests[req_id]
            assert req.num_output_tokens + req.num_pending_tokens <= req.max_tokens, "scheduled past max_tokens"
            if req.num_computed_tokens == req.num_tokens + req.num_pending_tokens - 1:  # reached its end: samples
                samplers.append(req_id)
        if pending is not None:
            prev, prev_samplers = pending
            n = len(prev_samplers)
            s.update_from_output(prev, ModelRunnerOutput(prev_samplers, [1] * n, [None] * n))
            s.block_manager.check_integrity()
        pending = (out, samplers) if not out.is_empty else None
    raise AssertionError("did not finish")


def test_overlapped_steps_respect_max_tokens_and_preemption():
    s = make_scheduler(num_blocks=7, block_size=4, max_tokens_per_step=16)
    reqs = [make_req(f"r{i}", 6, max_tokens=9) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    overlapped_run(s)
    assert all(len(r.output_token_ids) == 9 for r in reqs)
    assert all(r.num_pending_tokens == 0 for r in reqs)
    assert s.num_preemptions > 0
    assert s.block_manager.num_free_blocks == 7
