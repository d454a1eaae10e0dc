"""Speculative decoding at tensor_parallel_size=2 (two Ray worker actors over gloo, CPU): rank 0 verifies the drafts
and broadcasts the tokens it keeps, so rank 1's request states (tokens, computed positions, the blocks given back)
stay in step. Greedy output equals the same tp=2 engine's without speculation, under preemption and chunked prefill
(tests/cluster/test_tensor_parallel.py's stress settings, a larger token budget)."""

import pytest

from pagoda import LLM, SamplingParams
from tests.cluster.test_tensor_parallel import STRESS
from tests.engine.test_spec_decode import NGRAM, PROMPTS, OracleProposer, _assert_same, _references

# 31 s the two: make test stays under 15 minutes on 2 cores; CI runs them in test-slow
pytestmark = pytest.mark.slow


def test_tp2_speculation_gives_the_plain_tp2_output(ray_cluster, tiny_checkpoints):
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
    args = dict(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", tensor_parallel_size=2,
                **(STRESS | {"max_num_batched_tokens": 24}))  # the four run at once: preemptions
    plain_llm = LLM(**args)
    plain = plain_llm.generate(PROMPTS, params, use_tqdm=False)
    plain_llm.shutdown()
    llm = LLM(**args, speculative_config=NGRAM)
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        llm.engine.spec.proposer = OracleProposer(_references(PROMPTS, plain), 4)
        spec = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.engine.check_integrity()
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
        assert llm.engine.scheduler.num_preemptions > 0
        _assert_same(plain, spec)
        again = llm.generate(PROMPTS[:2], params, use_tqdm=False)  # the ranks' states stayed in step
        _assert_same(plain[:2], again)
    finally:
        llm.shutdown()


def test_tp2_draft_model_gives_the_plain_tp2_output(ray_cluster, tiny_checkpoints):
    """The draft model sharded over the same two ranks as the target (the tiny Llama drafting for itself): every
    rank runs its passes (rank 0's argmax broadcast as the next input), rank 0's drafts are the step's; the plain
    tp=2 output, every draft accepted, and both ranks' draft books consistent, under preemption and chunked
    prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
    model = tiny_checkpoints["llama"]
    args = dict(model=model, dtype="float32", device="cpu", tensor_parallel_size=2,
                **(STRESS | {"max_num_batched_tokens": 24}))
    plain_llm = LLM(**args)
    plain = plain_llm.generate(PROMPTS, params, use_tqdm=False)
    plain_llm.shutdown()
    llm = LLM(**args, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 3,
                                          "disable_by_batch_size": 1024})  # every step speculates, whatever it costs
    try:
        spec = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.engine.check_integrity()  # both ranks' draft pools (RayExecutor.check_integrity)
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 30 and stats.acceptance_rate == 1.0
        assert llm.engine.scheduler.num_preemptions > 0
        _assert_same(plain, spec)
    finally:
        llm.shutdown()
