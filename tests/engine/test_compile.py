"""compilation_config level 3 (torch.compile around Pagoda's kernels, workers/compile.py) on CPU: inductor's C++
code for the glue, the kernels' torch references inside the opaque ops. Greedy tokens equal transformers' (and the
FP8 oracle's) under preemption, chunked prefill and prefix caching; the forward is one graph per kind of step, never
recompiled step after step; what level 3 does not compile is refused by name.

CUDA graphs capturing the compiled code are a GPU matter: tests/gpu/test_compile_gpu.py."""

import pytest
from torch._dynamo.utils import counters

from engine.config import CompilationConfig, EngineArgs
from engine.errors import ParamError
from pagoda import LLM
from tests.cluster.test_tensor_parallel import STRESS
from tests.engine import test_fp8_parity as fp8
from tests.engine.test_llm_parity import assert_same_tokens, hf_reference, run_pagoda
from workers.compile import CompiledForward

# Kinds of steps a workload of prompts under STRESS takes: prefill chunks and decodes, each also of one token or one
# sequence (sizes of 1 are specialized). More graphs than this would be a guard on something that changes each step.
MAX_GRAPHS = 4


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _compiled(llm) -> bool:
    return isinstance(llm.engine.executor.worker.model.forward, CompiledForward)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_greedy_tokens_equal_transformers(tiny_checkpoints, arch):
    """Llama, and Qwen3's RMSNorm over each q and k head, under preemption, chunked prefill and prefix caching."""
    model_dir = tiny_checkpoints[arch]
    before = _graphs()
    llm, outs = run_pagoda(model_dir, compilation_config=3, **STRESS)
    try:
        assert _compiled(llm)
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits_tokens > 0
        assert_same_tokens(model_dir, outs)
        for (_, ref_tokens, ref_logprobs), out in zip(hf_reference(model_dir), outs):
            for step, (token_id, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs)):
                assert abs(entry[token_id] - ref_logprobs[step][token_id].item()) < 1e-4
        assert 1 <= _graphs() - before <= MAX_GRAPHS
    finally:
        llm.shutdown()


def test_compiled_fp8_weights_and_kv_match_the_oracle(tiny_checkpoints):
    """FP8: the per-token quantization of activations is inductor's code (fused with the norm before it), the
    GEMMs and the e4m3 KV write are the ops; the tokens are the FP8 oracle's, as the eager engine's."""
    model_dir = tiny_checkpoints["llama"]
    llm, outs = fp8.run(model_dir, compilation_config={"level": 3}, **STRESS)
    try:
        assert _compiled(llm)
        fp8.assert_matches(fp8.oracle(model_dir), outs)
    finally:
        llm.shutdown()


def test_level_0_runs_the_model_eagerly(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, dtype="float32", device="cpu", num_kv_blocks=64, compilation_config=0)
    try:
        assert not _compiled(llm)
        assert llm.engine.config.compilation == CompilationConfig(0)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("value, param", [
    (1, "compilation_config.level"), (2, "compilation_config.level"), ({"level": 4}, "compilation_config.level"),
    ({"level": 3, "cudagraph_mode": "full"}, "compilation_config.cudagraph_mode"),
    ({"level": 3, "mode": 0}, "compilation_config.mode"), ("fast", "compilation_config"),
    ({"level": True}, "compilation_config.level"),
])
def test_bad_compilation_configs_are_refused_by_name(value, param):
    with pytest.raises(ParamError) as e:
        EngineArgs(compilation_config=value)
    assert e.value.param == param


@pytest.mark.parametrize("value", [3, "3", {"level": 3}, {"mode": 3}, {"level": 3, "mode": 3}])
def test_the_spellings_of_level_3(value):
    assert CompilationConfig.from_value(value) == CompilationConfig(3)


@pytest.mark.parametrize("arch, kwargs, names", [
    ("mixtral", {}, "MixtralForCausalLM"),
    ("llama", {"enforce_eager": True}, "enforce_eager"),
    ("llama", {"enable_lora": True}, "LoRA"),
    ("llama", {"quantization": "awq", "load_format": "random"}, "awq"),
])
def test_what_level_3_does_not_compile_is_refused(tiny_checkpoints, arch, kwargs, names):
    args = EngineArgs(model=tiny_checkpoints[arch], device="cpu", compilation_config=3, **kwargs)
    with pytest.raises(ParamError, match=names) as e:
        args.create_engine_config()
    assert e.value.param == "compilation_config.level"


def test_cli_flags(tiny_model_dir):
    import argparse

    from engine.arg_utils import add_engine_args, engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags in (["-O3"], ["-O", "3"], ["--compilation-config", '{"level": 3}']):
        args = engine_args(parser.parse_args(["--model", tiny_model_dir] + flags))
        assert CompilationConfig.from_value(args.compilation_config) == CompilationConfig(3), flags
    assert engine_args(parser.parse_args(["--model", tiny_model_dir])).compilation_config is None
