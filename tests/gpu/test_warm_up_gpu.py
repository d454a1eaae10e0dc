"""What an engine's start-up compiles is all that serving compiles: after start-up, no request, whatever its
sampling settings, batch size or constraint, waits for a Triton kernel to compile (each took 0.4-0.7 s of an H200's
step loop while every request in it waited)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.structured_outputs import StructuredOutputsParams  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
          "required": ["a", "b"]}
SETTINGS = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.7, top_p=0.9, top_k=50,
            repetition_penalty=1.1), dict(temperature=1.0, top_k=5), dict(temperature=1.0, top_k=300),
            dict(temperature=1.0, min_p=0.1, logprobs=3), dict(temperature=1.0, presence_penalty=0.5, n=2),
            dict(temperature=1.0, logit_bias={5: 2.0}), dict(temperature=0.0, structured_outputs=SCHEMA),
            dict(temperature=1.0, top_k=40, structured_outputs=SCHEMA)]


def test_no_kernel_compiles_after_start_up(tiny_model_dir):
    from triton import knobs

    compiled = []
    llm = LLM(model=tiny_model_dir, enable_prefix_caching=False)
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        for i, setting in enumerate(SETTINGS):
            setting = dict(setting)
            if "structured_outputs" in setting:
                setting["structured_outputs"] = StructuredOutputsParams(json=setting["structured_outputs"])
            for batch in (1, 3, 17, 64):
                prompts = [{"prompt_token_ids": [(7 * j + i) % 900 + 10] * (5 + j)} for j in range(batch)]
                llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, **setting), use_tqdm=False)
    finally:
        knobs.runtime.jit_post_compile_hook = previous
        llm.shutdown()
    assert compiled == []


def test_no_kernel_compiles_after_start_up_with_steps_launched_ahead(tiny_model_dir, monkeypatch):
    """With n-gram speculation launched ahead (PAGODA_SPEC_RUN_AHEAD=1): the device lookup, the inputs' fix-up and
    the histories' append (kernels/ngram.py, kernels/run_ahead.py) are compiled at start-up too, one variant each
    whatever a step's rows, widths and counts."""
    from triton import knobs

    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "1")
    compiled = []
    llm = LLM(model=tiny_model_dir, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        for i, setting in enumerate(SETTINGS[:3] + SETTINGS[-2:]):
            setting = dict(setting)
            if "structured_outputs" in setting:
                setting["structured_outputs"] = StructuredOutputsParams(json=setting["structured_outputs"])
            for batch in (1, 3, 17):
                prompts = [{"prompt_token_ids": [10 + i, 11, 12, 13] * (3 + j)} for j in range(batch)]
                llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, **setting), use_tqdm=False)
        assert llm.engine.spec.num_steps_ahead > 0
    finally:
        knobs.runtime.jit_post_compile_hook = previous
        llm.shutdown()
    assert compiled == []
