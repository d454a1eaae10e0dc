"""Penalties end to end, as vLLM defines them: repetition over prompt and output tokens, frequency and presence over
output tokens. They read the token histories the runner keeps on the device, so steps stay overlapped: greedy
tokens equal transformers' generate with the same penalties (its own repetition penalty, and the full definition as
a logits processor) under overlap, preemption and chunked prefill, and seeded sampling with penalties gives the
same tokens whatever the schedule."""

import functools

import pytest
import torch

from engine.llm_engine import LLMEngine
from pagoda import LLM, SamplingParams
from tests.engines import llm_engine
from tests.prompts import PARITY_PROMPTS

MAX_NEW = 12
PENALTIES = {
    "none": {},
    "repetition": dict(repetition_penalty=3.0),
    "frequency+presence": dict(frequency_penalty=-1.0, presence_penalty=-1.0),  # rewards repeats: they bite
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.3),
}


def vllm_penalties(prompt_len: int, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0):
    """vLLM's penalties on dense counts, as a transformers logits processor: the specification."""
    from transformers import LogitsProcessor

    class Penalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, input_ids, True)
            out = input_ids[:, prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
            scores = torch.where(seen, torch.where(scores > 0, scores / repetition_penalty,
                                                   scores * repetition_penalty), scores)
            return scores - frequency_penalty * counts - presence_penalty * (counts > 0).to(scores.dtype)

    return Penalties()


@functools.lru_cache(maxsize=None)
def hf_greedy(model_dir: str, penalties: str, builtin: bool = False) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy tokens under the penalties (`builtin`: its own repetition_penalty instead)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in PARITY_PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        extra = dict(PENALTIES[penalties]) if builtin else {
            "logits_processor": LogitsProcessorList([vllm_penalties(ids.shape[1], **PENALTIES[penalties])])}
        seq = model.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=tok.pad_token_id, **extra)
        out.append(tuple(seq[0, ids.shape[1]:].tolist()))
    return tuple(out)


def run_engine(model_dir: str, params: SamplingParams, prompts=PARITY_PROMPTS, overlap: bool = True,
               **kwargs) -> tuple[dict[str, list[list[int]]], LLMEngine, int]:
    """Steps an engine by hand; returns each request's completions, the engine and how many steps ran with a
    step in flight (overlapped)."""
    engine = llm_engine(model=model_dir, dtype="float32", device="cpu", **kwargs)
    engine.executor.supports_overlap = overlap
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, stream=False)  # one delta each: the whole output, at the end
    done, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [seq.token_ids for seq in sorted(out.seqs, key=lambda s: s.index)]
        overlapped += engine._pending is not None and engine._pending.overlapped
    engine.check_integrity()
    return done, engine, overlapped


def greedy_params(penalties: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, **PENALTIES[penalties])


@pytest.mark.parametrize("penalties", ["repetition", "frequency+presence", "all"])
def test_greedy_penalties_match_transformers_with_overlapped_steps(tiny_checkpoints, penalties):
    model_dir = tiny_checkpoints["llama"]
    done, engine, overlapped = run_engine(model_dir, greedy_params(penalties), num_kv_blocks=256)
    assert overlapped >= MAX_NEW - 1  # the penalized requests ran with a step in flight (0 before)
    expected = hf_greedy(model_dir, penalties)
    assert [tuple(done[f"r{i}"][0]) for i in range(len(PARITY_PROMPTS))] == list(expected)
    assert expected != hf_greedy(model_dir, "none")  # the penalties changed the greedy answer
    engine.shutdown()


def test_repetition_penalty_is_transformers_own(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    assert hf_greedy(model_dir, "repetition", builtin=True) == hf_greedy(model_dir, "repetition")


@pytest.mark.parametrize("schedule", [dict(block_size=4, num_kv_blocks=24), dict(block_size=4,
                                                                                 max_num_batched_tokens=7)],
                         ids=["preemption", "chunked-prefill"])
def test_greedy_penalties_survive_preemption_and_chunked_prefill(tiny_checkpoints, schedule):
    model_dir = tiny_checkpoints["llama"]
    done, engine, _ = run_engine(model_dir, greedy_params("all"), **schedule)
    if "num_kv_blocks" in schedule:
        assert engine.scheduler.num_preemptions > 0  # resumed requests rebuilt their histories
    assert [tuple(done[f"r{i}"][0]) for i in range(len(PARITY_PROMPTS))] == list(hf_greedy(model_dir, "all"))
    runner = engine.executor.worker.runner
    engine.step()  # the workers drop what finished last
    assert not runner.requests
    assert len(runner.history.free_slots) == runner.history.tokens.shape[0]  # every slot came back
    engine.shutdown()


def test_seeded_sampling_with_penalties_and_n_completions_whatever_the_schedule(tiny_model_dir):
    params = SamplingParams(n=2, temperature=1.0, top_k=40, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True,
                            repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    prompts = ["The quick brown fox", "Once upon a time there was", "def fibonacci(n):", "Hello"]
    roomy, _, overlapped = run_engine(tiny_model_dir, params, prompts, num_kv_blocks=256)
    assert overlapped > 0
    crowded, engine, _ = run_engine(tiny_model_dir, params, prompts, overlap=False, block_size=4,
                                    num_kv_blocks=14, max_num_batched_tokens=9, max_num_seqs=3)
    assert engine.scheduler.num_preemptions > 0
    assert crowded == roomy
    assert all(first != second for first, second in roomy.values())  # each sequence has its own seed
    plain = SamplingParams(n=2, temperature=1.0, top_k=40, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    assert run_engine(tiny_model_dir, plain, prompts, num_kv_blocks=256)[0] != roomy


def test_offline_llm_with_the_seed_guide_settings(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, device="cpu", num_kv_blocks=256)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1, max_tokens=20, seed=3)
    first = llm.generate(PARITY_PROMPTS, params, use_tqdm=False)
    again = llm.generate(PARITY_PROMPTS[::-1], params, use_tqdm=False)[::-1]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    llm.engine.check_integrity()
    llm.shutdown()
