"""Structured outputs on a CUDA GPU: the Triton mask kernel, CUDA graphs, deferred sampling (the forward runs while
the driver fills the bitmask) and the pinned-memory copies; the same guarantees and tokens as on CPU."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagoda import LLM, SamplingParams  # noqa: E402
from tests.structured_cases import cases, check_output  # noqa: E402


def workload():
    params = [SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=120,
                             structured_outputs=case) for case in cases().values() for seed in (None, 1, 2)]
    params.append(SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))  # unconstrained, same batch
    return ["Hello", "The quick brown fox"] * (len(params) // 2) + ["Hello"] * (len(params) % 2), params


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_constrained_outputs_valid_and_equal_overlapped_or_not(tiny_checkpoints, enforce_eager):
    prompts, params = workload()
    results = []
    for overlap in (True, False):
        llm = LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cuda", num_kv_blocks=512,
                  enforce_eager=enforce_eager)
        assert llm.engine.executor.supports_deferred_sampling
        llm.engine.executor.supports_overlap = overlap
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, out in zip(params, outs):
            if p.structured_outputs is not None:
                assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
                check_output(p.structured_outputs, out.outputs[0].text)
        assert llm.engine.structured.stats.num_fills > 0
        llm.engine.check_integrity()
        llm.shutdown()
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def test_gpu_constrained_under_preemption(tiny_checkpoints):
    prompts, params = workload()
    llm = LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cuda", block_size=16, num_kv_blocks=12,
              max_num_batched_tokens=32, max_num_seqs=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(params, outs):
        if p.structured_outputs is not None:
            check_output(p.structured_outputs, out.outputs[0].text)
    llm.engine.check_integrity()
    llm.shutdown()
