"""Structured outputs with tensor_parallel_size 2 (real Ray worker actors over gloo): sampling deferred as on one
rank, the step after a constrained step launched before the driver has that step's tokens, and its bitmask sent to
the ranks once it has them. The same tokens as the in-process single rank, every output valid, streamed or not,
under preemption and chunked prefill, with n > 1."""

import pytest

from pagoda import LLM, SamplingParams
from tests.engines import llm_engine
from tests.structured_cases import cases, check_output

STRESS = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=6)


def workload() -> list[tuple[str, SamplingParams]]:
    work = []
    for i, name in enumerate(["json-person", "json-records", "regex", "choice", "grammar"]):
        work.append((name, SamplingParams(temperature=1.0, seed=20 + i, n=2 if i == 0 else 1, max_tokens=60,
                                          structured_outputs=cases()[name])))
    work.append(("plain", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
    return work


@pytest.mark.slow  # 7-18 s of make test's 15 minutes on 2 cores: CI's slow suite runs it
def test_tp2_constrained_tokens_match_one_rank_streamed_and_not(ray_cluster, tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    work = workload()
    one_rank = LLM(model=model_dir, dtype="float32", device="cpu", **STRESS)
    assert one_rank.engine.executor.supports_deferred_sampling
    reference = one_rank.generate(["Hello"] * len(work), [p for _, p in work], use_tqdm=False)
    assert one_rank.engine.scheduler.num_preemptions > 0
    one_rank.shutdown()

    engine = llm_engine(model=model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, **STRESS)
    assert type(engine.executor).__name__ == "RayExecutor" and engine.executor.supports_deferred_sampling
    events = record_steps(engine.executor)
    for name, params in work:
        engine.add_request(name, "Hello", params)  # streamed: a delta whenever a sequence moves
    streamed: dict[tuple[str, int], list] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for seq in delta.seqs:
                streamed.setdefault((delta.request_id, seq.index), []).append(seq)
    assert engine.scheduler.num_preemptions > 0
    engine.check_integrity()
    # Overlap with grammars: a step whose constrained rows awaited their bitmask got it, and the step after it
    # was launched before it was collected (before: steps ran one by one while constrained requests ran).
    order = {event: i for i, event in enumerate(events)}
    launched = [step for kind, step in events if kind == "launch"]
    deferred = [step for kind, step in events if kind == "sample"]
    assert deferred, "no step deferred its sampling"
    overlapped = [step for step in deferred if step + 1 < len(launched)
                  and order[("launch", step + 1)] < order[("collect", step)]]
    assert len(overlapped) > len(deferred) // 2, (len(overlapped), len(deferred))
    assert all(order[("sample", step)] < order[("collect", step)] for step in deferred)
    for (name, params), ref in zip(work, reference):
        for ref_c in ref.outputs:
            deltas = streamed[(name, ref_c.index)]
            assert [t for d in deltas for t in d.token_ids] == ref_c.token_ids, name
            text = "".join(d.text for d in deltas)
            assert text == ref_c.text and deltas[-1].finish_reason == ref_c.finish_reason
            if params.structured_outputs is not None:
                assert ref_c.finish_reason == "stop", (name, text)
                check_output(params.structured_outputs, text)
    engine.shutdown()


def record_steps(executor) -> list[tuple[str, int]]:
    """(what, the step's launch index) for each launch, sample and collect the engine asks of the executor."""
    events, index, handles = [], {}, []  # (the handles kept: no id is reused)
    launch, sample, collect = executor.launch, executor.sample, executor.collect

    def launch_(sched):
        handle = launch(sched)
        handles.append(handle)
        index[id(handle)] = len(handles) - 1
        events.append(("launch", index[id(handle)]))
        return handle

    def sample_(handle, bitmask):
        events.append(("sample", index[id(handle)]))
        return sample(handle, bitmask)

    def collect_(handle):
        events.append(("collect", index[id(handle)]))
        return collect(handle)

    executor.launch, executor.sample, executor.collect = launch_, sample_, collect_
    return events
