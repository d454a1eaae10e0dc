"""Speculative decoding with a draft model on a CUDA GPU (#34): the draft's pool sized with the target's by the memory
profile, its decode passes under its own CUDA graphs beside the target's, greedy output the plain engine's."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagoda import LLM, SamplingParams  # noqa: E402
from tests.engine.test_spec_decode import COPY_PROMPTS, _assert_same  # noqa: E402

PROMPTS = COPY_PROMPTS + [[{"role": "user", "content": "Write a short poem about the sea."}],
                          [{"role": "user", "content": "List three prime numbers and explain why."}]]


def test_smollm2_drafting_for_itself_on_a_gpu(real_model_dir):
    """float32 (bf16 would let the verify step's extend kernels and the plain decode graphs round apart): the plain
    engine's tokens, nearly every draft accepted (the draft's decode passes and the target's extend pass are other
    kernels: a near-tie may fall the other way), and every draft block back at the end."""
    params = SamplingParams(temperature=0.0, max_tokens=96, logprobs=1, ignore_eos=True)
    args = dict(model=real_model_dir, dtype="float32", device="cuda", gpu_memory_utilization=0.3)
    plain_llm = LLM(**args)
    plain = plain_llm.chat(PROMPTS, params, use_tqdm=False)
    plain_blocks = plain_llm.engine.executor.num_kv_blocks
    plain_llm.shutdown()
    llm = LLM(**args, speculative_config={"method": "draft_model", "model": real_model_dir,
                                          "num_speculative_tokens": 4})
    try:
        spec = llm.chat(PROMPTS, params, use_tqdm=False)
        llm.engine.step()
        llm.engine.check_integrity()
        draft = llm.engine.executor.worker.draft
        assert draft.num_free_blocks == draft.num_blocks == llm.engine.executor.num_kv_blocks
        assert draft.num_blocks < plain_blocks  # the profile left room for the draft's pool
        assert draft.graphs is not None and draft.graphs.num_replays > 0  # its decode passes replayed its graphs
        assert draft.graphs.num_verify_replays > 0  # and its catch-ups (the accepted tokens) its verify graphs
        stats = llm.engine.scheduler.spec_stats
        assert stats.acceptance_rate > 0.95, stats
        _assert_same(plain, spec, atol=1e-3)
    finally:
        llm.shutdown()


def test_smollm2_sampled_drafts_on_a_gpu(real_model_dir):
    """Temperature 1, seeded: the draft model draws its drafts from its own softmax (q) and the Triton rejection
    kernel accepts them with min(1, p / q). SmolLM2 drafting for itself has q = p up to the two paths' rounding, so
    nearly every draft is accepted, where one-hot (greedy) drafts of sampled requests would be accepted only as
    often as p gives its argmax. Seeded requests give the same tokens in two runs; every draft block comes back."""
    params = [SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=s) for s in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        llm = LLM(model=real_model_dir, dtype="float32", device="cuda", gpu_memory_utilization=0.3,
                  speculative_config={"method": "draft_model", "model": real_model_dir, "num_speculative_tokens": 4})
        try:
            runs.append([o.outputs[0].token_ids for o in llm.chat(PROMPTS, params, use_tqdm=False)])
            llm.engine.step()
            llm.engine.check_integrity()
            draft = llm.engine.executor.worker.draft
            assert draft.num_free_blocks == draft.num_blocks and not draft.probs
            stats = llm.engine.scheduler.spec_stats
            assert stats.num_draft_tokens > 100 and stats.acceptance_rate > 0.9, stats
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
