"""Speculative decoding at tensor_parallel_size=2 (two Ray worker actors over gloo, CPU): rank 0 verifies the drafts
and broadcasts the tokens it keeps, so rank 1's request states (tokens, computed positions, the blocks given back)
stay in step. Greedy output equals the same tp=2 engine's without speculation, under preemption and chunked prefill
(tests/cluster/test_tensor_parallel.py's stress settings, a larger token budget)."""

import pytest
import ray

from pagoda import LLM, SamplingParams
from tests.cluster.test_tensor_parallel import STRESS
from tests.engine.test_spec_decode import NGRAM, PROMPTS, OracleProposer, _assert_same, _references
from tests.spec_proposers import OracleLookup

# ~45 s the three: make test stays under 15 minutes on 2 cores; CI runs them in test-slow
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("on_device", [False, True], ids=["host-drafts", "device-drafts"])
def test_tp2_speculation_gives_the_plain_tp2_output(ray_cluster, tiny_checkpoints, on_device):
    """Drafts from the driver (pipelined steps), or proposed on the ranks, each from its own copy of the token
    histories (the same drafts), in verify steps launched before the one in flight is read back: a Ray rank reads
    each step before it takes the next, so its counts run ahead of the driver's by the drafts rejected, and the
    blocks they held go when the driver's next step says (CachedRequestData.num_kept_blocks)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
    args = dict(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", tensor_parallel_size=2,
                **(STRESS | {"max_num_batched_tokens": 24}))  # the four run at once: preemptions
    plain_llm = LLM(**args)
    plain = plain_llm.generate(PROMPTS, params, use_tqdm=False)
    plain_llm.shutdown()
    llm = LLM(**args, speculative_config=NGRAM)
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        refs = _references(PROMPTS, plain)
        if on_device:
            ray.get([actor.__ray_call__.remote(_install_lookup, refs) for actor in llm.engine.executor.actors])
        else:
            llm.engine.spec.proposer = OracleProposer(refs, 4)
        spec = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.engine.check_integrity()
        stats = llm.engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert (llm.engine.spec.num_steps_ahead > 0) == on_device
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


def test_tp2_constrained_requests_run_ahead_as_one_rank(ray_cluster, tiny_checkpoints):
    """Grammars in verify steps launched ahead, over two ranks: each answers the step with its constrained rows
    awaiting their bitmask, rank 0 with the drafts it proposed (AwaitingBitmask), and the driver's bitmask follows
    them as far as each grammar accepts. Every rank the same drafts (a digit among letters under [a-z]); the tokens
    of the in-process single rank given the same drafts, every output in its grammar, under preemption."""
    from engine.structured_outputs import StructuredOutputsParams
    from tests.engine.test_spec_decode import FixedLookup, _letters_and_a_digit

    regex = StructuredOutputsParams(regex="[a-z]{3,80}")
    args = dict(model=tiny_checkpoints["llama"], dtype="float32", device="cpu",
                **(STRESS | {"max_num_batched_tokens": 24}), speculative_config=NGRAM)
    one = LLM(**args)
    letters, digit = _letters_and_a_digit(one.get_tokenizer())
    drafts = letters[:1] + [digit] + letters[1:]
    bias = {letters[0]: 2.5, letters[1]: 2.0, digit: 4.0}
    params = [SamplingParams(temperature=0.9, max_tokens=30, seed=s, logit_bias=bias, structured_outputs=regex)
              for s in range(2)]
    params += [SamplingParams(temperature=0.0, max_tokens=30, logit_bias=bias, structured_outputs=regex),
               SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    prompts = PROMPTS[:len(params)]
    one.engine.executor.worker.runner.lookup = FixedLookup(drafts)
    reference = one.generate(prompts, params, use_tqdm=False)
    assert one.engine.spec.num_steps_ahead > 0
    one.shutdown()
    llm = LLM(**args, tensor_parallel_size=2)
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        ray.get([actor.__ray_call__.remote(_install_fixed_lookup, drafts) for actor in llm.engine.executor.actors])
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_integrity()
        stats = llm.engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and llm.engine.spec.num_steps_ahead > 0
        assert llm.engine.scheduler.num_preemptions > 0
        for out, ref, sp in zip(outs, reference, params):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            if sp.structured_outputs is not None:
                text = out.outputs[0].text
                assert text.isalpha() and text.islower() and len(text) >= 3, text
    finally:
        llm.shutdown()


def _install_fixed_lookup(actor, drafts) -> None:
    from tests.engine.test_spec_decode import FixedLookup

    actor.worker.runner.lookup = FixedLookup(drafts)


def _install_lookup(actor, references) -> None:
    """On a worker actor: the oracle in the place of the runner's n-gram lookup (every rank the same drafts)."""
    actor.worker.runner.lookup = OracleLookup(references, 4)
