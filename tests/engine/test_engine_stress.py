"""A randomized workload: shared prefixes, n > 1, stop strings, penalties, aborts, a pool small enough to preempt and
token budgets small enough to chunk, with and without overlapped steps. Block-manager invariants hold after every step,
nothing leaks, and every completion (greedy, or sampled with a seed) equals the one the same request gets alone in
a roomy engine."""

import random

import pytest

from engine.sampling_params import SamplingParams
from tests.engines import llm_engine
from tests.workloads import run_workload

WORDS = "the quick brown fox jumps over a lazy dog while models read prompts and write tokens".split()


def make_workload(seed: int, num: int = 40):
    rng = random.Random(seed)
    prefix = " ".join(rng.choices(WORDS, k=12))
    work = []
    for i in range(num):
        body = " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))
        prompt = f"{prefix} {body}" if rng.random() < 0.5 else body
        n = rng.choice([1, 1, 1, 2, 3])
        greedy = rng.random() < 0.6  # n > 1 greedy: every completion must be the one greedy answer
        penalties = rng.choice([{}, {}, {"repetition_penalty": 1.5},
                                {"frequency_penalty": -1.0, "presence_penalty": 0.5, "repetition_penalty": 0.8}])
        params = SamplingParams(n=n, temperature=0.0 if greedy else 1.0, seed=rng.randint(0, 99),
                                max_tokens=rng.randint(1, 24), ignore_eos=True,
                                stop=[rng.choice(WORDS)] if rng.random() < 0.2 else None, **penalties)
        work.append((f"req{i}", prompt, params, rng.random() < 0.15))  # the last: abort it mid-way
    return work


def by_index(delta):
    return sorted(delta.seqs, key=lambda s: s.index)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow) for s in range(2, 6))])  # CI: all
def test_random_workload_keeps_invariants_and_greedy_tokens(tiny_model_dir, seed, overlap):
    engine = llm_engine(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=40,
                        max_num_batched_tokens=24, max_num_seqs=6)
    run_and_compare_with_each_alone(engine, tiny_model_dir, seed, overlap)


def run_and_compare_with_each_alone(engine, tiny_model_dir, seed: int, overlap: bool) -> None:
    """Runs make_workload(seed) on `engine` (a small pool), checking the block manager after every step, then each
    request alone in a roomy engine: the same tokens."""
    work = make_workload(seed)
    engine.executor.supports_overlap = overlap
    rng = random.Random(seed + 100)
    finished, aborted = run_workload(engine, work, rng, abort_probability=0.3,
                                     check=engine.block_manager.check_integrity)
    engine.step()  # the workers drop what finished last
    engine.check_integrity()
    runner = engine.executor.worker.runner
    assert not runner.requests
    assert len(runner.history.free_slots) == runner.history.tokens.shape[0]  # every penalty slot came back
    assert engine.scheduler.num_preemptions > 0  # the pool was small enough to matter
    assert set(finished) | aborted == {w[0] for w in work}

    roomy = llm_engine(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=512)
    for req_id, prompt, params, _ in work:
        if req_id in aborted:
            continue
        # Greedy and seeded sampling alike: a request's tokens depend on nothing else in the batch.
        roomy.add_request(req_id, prompt, SamplingParams(
            n=params.n, temperature=params.temperature, seed=params.seed, max_tokens=params.max_tokens,
            ignore_eos=True, stop=params.stop, repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty), stream=False)
        alone = None
        while roomy.has_unfinished_requests():
            for out in roomy.step():
                alone = out
        # stream=False: the only delta is the last, with each sequence's whole output
        for completion, reference in zip(by_index(finished[req_id]), by_index(alone)):
            assert completion.token_ids == reference.token_ids, (req_id, completion.index)
            assert completion.text == reference.text
            if params.is_greedy:  # n > 1 greedy: every completion is the one greedy answer
                assert completion.token_ids == by_index(alone)[0].token_ids
    for out in finished.values():
        assert len(out.seqs) == work[int(out.request_id[3:])][2].n
    engine.shutdown()
    roomy.shutdown()
