"""prompt_logprobs (vLLM's field) against transformers' logits, on the tiny checkpoint: whole prompts, chunked
prefill, preemption, n > 1, prefix-cache hits (disabled for the requests that ask), streaming (delta) outputs."""

from dataclasses import replace

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.engines import llm_engine
from tests.hf_oracle import assert_matches_hf
from tests.prompts import PARITY_PROMPTS, PREFIX

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3, logprobs=3)


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()


def make_llm(tiny_checkpoints, **kwargs) -> LLM:
    return LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", **{"num_kv_blocks": 256, **kwargs})


@pytest.mark.parametrize("settings", [dict(block_size=16), dict(block_size=4, max_num_batched_tokens=7),
                                      dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)],
                         ids=["whole-prompts", "chunked-prefill", "preemption"])
def test_prompt_logprobs_match_transformers(tiny_checkpoints, hf_model, settings):
    llm = make_llm(tiny_checkpoints, **settings)
    outs = llm.generate(PARITY_PROMPTS, PARAMS, use_tqdm=False)
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0, "the settings no longer preempt"
    for out in outs:
        assert_matches_hf(hf_model, out, num_top=3, atol=1e-4)
    llm.engine.check_integrity()


def test_a_prefix_cache_hit_is_skipped_only_for_requests_that_want_prompt_logprobs(tiny_checkpoints, hf_model):
    llm = make_llm(tiny_checkpoints, block_size=4, max_num_seqs=1)
    warm, plain, scored = PREFIX + "Hello there.", PREFIX + "Hi.", PREFIX + "What is the capital of France?"
    llm.generate([warm], SamplingParams(max_tokens=1), use_tqdm=False)
    hit = llm.generate([plain], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= 16 and hit.prompt_logprobs is None
    out = llm.generate([scored], PARAMS, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    assert_matches_hf(hf_model, out, num_top=3, atol=1e-4)
    llm.engine.check_integrity()


def test_n_completions_report_the_prompt_logprobs_once(tiny_checkpoints, hf_model):
    llm = make_llm(tiny_checkpoints, block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=0)
    out = llm.generate([PARITY_PROMPTS[1]], params, use_tqdm=False)[0]
    single = llm.generate([PARITY_PROMPTS[1]], PARAMS, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert [set(e) for e in out.prompt_logprobs[1:]] == [{t} for t in out.prompt_token_ids[1:]]  # top 0: own only
    for entry, full in zip(out.prompt_logprobs[1:], single.prompt_logprobs[1:]):
        (token_id, logprob), = entry.items()
        assert abs(full[token_id] - logprob) < 1e-5


def test_streaming_outputs_carry_them_once_and_short_prompts(tiny_checkpoints):
    engine = llm_engine(model=tiny_checkpoints["llama"], dtype="float32", device="cpu", num_kv_blocks=64,
                                 stream_interval_s=0.0)
    engine.add_request("long", PARITY_PROMPTS[3], replace(PARAMS, max_tokens=5, min_tokens=5))
    engine.add_request("one", {"prompt_token_ids": [7]}, replace(PARAMS, max_tokens=2))
    outputs: dict[str, list] = {"long": [], "one": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    long = outputs["long"]
    assert len(long) == 5 and long[0].prompt_logprobs is not None
    assert len(long[0].prompt_logprobs) == len(engine.tokenizer.encode(PARITY_PROMPTS[3]))
    assert all(out.prompt_logprobs is None for out in long[1:])
    (first,) = outputs["one"][0].prompt_logprobs  # a one-token prompt: nothing to score
    assert (first.token_id, first.logprob, first.top) == (7, None, [])
    engine.check_integrity()


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_is_an_error_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)
