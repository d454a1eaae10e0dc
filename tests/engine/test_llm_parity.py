"""End to end: greedy tokens of LLM.generate equal transformers' generate, token for token, for every family, and
under every scheduling regime (block sizes, preemption, chunked prefill, prefix caching), with sliding windows too."""

import functools

import pytest
import torch

from checkpoints.tiny import TINY_ARCHES, make_tiny_model
from pagoda import LLM, SamplingParams
from tests.prompts import PARITY_PROMPTS

MAX_NEW = 12
PROMPTS = PARITY_PROMPTS


@functools.lru_cache(maxsize=None)
def hf_reference(model_dir: str):
    """transformers' greedy generate: token ids and log-softmax of the raw logits at each step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        out = model.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        new = out.sequences[0, ids.shape[1]:].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
        results.append((ids[0].tolist(), new, logprobs))
    return results


def run_pagoda(model_dir, params=None, **kwargs):
    llm = LLM(model=model_dir, dtype="float32", device="cpu", **kwargs)
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.check_integrity()
    return llm, outs


def assert_same_tokens(model_dir, outs):
    for (prompt_ids, ref_tokens, _), out in zip(hf_reference(model_dir), outs):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == ref_tokens, f"prompt {out.prompt!r}"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", list(TINY_ARCHES))
def test_greedy_parity_and_logprobs(tiny_checkpoints, arch):
    model_dir = tiny_checkpoints[arch]
    _, outs = run_pagoda(model_dir)
    assert_same_tokens(model_dir, outs)
    for (_, ref_tokens, ref_logprobs), out in zip(hf_reference(model_dir), outs):
        completion = out.outputs[0]
        for step, (token_id, entry) in enumerate(zip(ref_tokens, completion.logprobs)):
            assert abs(entry[token_id] - ref_logprobs[step][token_id].item()) < 1e-4
            top2 = torch.topk(ref_logprobs[step], 2).indices.tolist()
            assert set(top2) <= set(entry)
            for tid in top2:
                assert abs(entry[tid] - ref_logprobs[step][tid].item()) < 1e-4


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_parity_across_block_sizes(tiny_checkpoints, block_size):
    model_dir = tiny_checkpoints["llama"]
    _, outs = run_pagoda(model_dir, block_size=block_size)
    assert_same_tokens(model_dir, outs)


def test_parity_with_preemption(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    llm, outs = run_pagoda(model_dir, block_size=4, num_kv_blocks=24)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_tokens(model_dir, outs)


def test_parity_with_chunked_prefill(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen2"]
    llm, outs = run_pagoda(model_dir, block_size=4, max_num_batched_tokens=7)
    assert_same_tokens(model_dir, outs)


def test_parity_with_prefix_caching_hits(tiny_checkpoints):
    model_dir = tiny_checkpoints["mistral"]
    llm, outs = run_pagoda(model_dir, block_size=4, max_num_seqs=1)  # one at a time: later prompts hit
    assert llm.engine.block_manager.prefix_hits_tokens > 0
    assert outs[5].metrics.num_cached_tokens >= 16
    assert_same_tokens(model_dir, outs)
    llm2, outs2 = run_pagoda(model_dir, block_size=4, enable_prefix_caching=False)
    assert llm2.engine.block_manager.prefix_hits_tokens == 0
    assert_same_tokens(model_dir, outs2)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Mistral with a 6-token window: most prompts and every generation run past it."""
    return make_tiny_model(str(tmp_path_factory.mktemp("windowed")), "mistral", seed=9,
                           config_overrides={"sliding_window": 6})


@pytest.mark.parametrize("kwargs", [dict(block_size=4, max_num_batched_tokens=7),  # chunks cross the window
                                    dict(block_size=4, max_num_seqs=1)],  # prefix-cache hits
                         ids=["chunked", "prefix_cached"])
def test_sliding_window_parity(windowed, kwargs):
    llm, outs = run_pagoda(windowed, **kwargs)
    assert_same_tokens(windowed, outs)
    if "max_num_seqs" in kwargs:
        assert llm.engine.block_manager.prefix_hits_tokens > 0
