"""compilation_config level 3 (torch.compile around Pagoda's kernels, workers/compile.py) on CPU: inductor's C++
code for the glue, the kernels' torch references inside the opaque ops. Greedy tokens equal transformers' (and the
FP8 oracle's) under preemption, chunked prefill and prefix caching; the forward is one graph per kind of step, never
recompiled step after step; what level 3 does not compile is refused by name.

CUDA graphs capturing the compiled code are a GPU matter: tests/gpu/test_compile_gpu.py."""

import pytest
from torch._dynamo.utils import counters

from engine.config import CompilationConfig, EngineArgs
from engine.errors import ParamError
from pagoda import LLM, LoRARequest
from tests.cluster.test_tensor_parallel import STRESS
from tests.engine import test_fp8_parity as fp8
from tests.engine.test_llm_parity import assert_same_tokens, hf_reference, run_pagoda
from tests.prompts import PARITY_PROMPTS
from workers.compile import CompiledForward

# Graphs of the decoder layer a workload under STRESS compiles: the first layer (no residual stream yet) and the
# others, each for prefill and decode steps, each also for one sequence (sizes of 1 are specialized). More would be a
# guard on something that changes each step or each layer (an int layer index made 8 graphs a layer).
MAX_GRAPHS = 8


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _compiled(llm) -> bool:
    return isinstance(llm.engine.executor.worker.model.forward, CompiledForward)


# Compiling costs 10-50 s a case under CPU: make test runs the compiled speculative engine (Llama's layers, plain and
# verify steps), CI's slow suite every case
SLOW = pytest.mark.slow


@SLOW
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_moe", "deepseek_v2"])
def test_compiled_greedy_tokens_equal_transformers(tiny_checkpoints, arch):
    """Llama, Qwen3's RMSNorm over each q and k head, Qwen2-MoE's routed experts (an op) and gated shared expert,
    DeepSeek-V2's latent attention (an op that writes the latent pool and attends) and group-limited routing, under
    preemption, chunked prefill and prefix caching."""
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


@SLOW
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_compiled_fp8_weights_and_kv_match_the_oracle(tiny_checkpoints, arch):
    """FP8: the per-token quantization of activations is inductor's code (fused with the norm before it), the
    GEMMs, FP8 experts and the e4m3 KV write are the ops; the tokens are the FP8 oracle's, as the eager engine's."""
    model_dir = tiny_checkpoints[arch]
    llm, outs = fp8.run(model_dir, compilation_config={"level": 3}, **STRESS)
    try:
        assert _compiled(llm)
        fp8.assert_matches(fp8.oracle(model_dir), outs)
    finally:
        llm.shutdown()


@SLOW
def test_compiled_mixed_batch_of_base_and_adapters_matches_peft(tiny_model_dir, tmp_path):
    """LoRA: the shrink and expand kernels as one op that adds to the GEMM op's output, rows of the base model and
    of two adapters in the same steps (and steps without adapter rows: a graph of their own), under chunked
    prefill and more adapters than slots."""
    from tests.engine import test_lora
    from tests.lora_adapters import make_adapter

    loras = [None] + [LoRARequest(name, i + 1, make_adapter(tiny_model_dir, str(tmp_path / name), rank, alpha,
                                                            targets, seed=i, use_rslora=rs))
                      for i, (name, (rank, alpha, targets, rs)) in enumerate(test_lora.ADAPTERS.items())
                      if name in ("qv", "all")]
    llm = test_lora.lora_llm(tiny_model_dir, max_loras=1, max_num_batched_tokens=8, compilation_config=3)
    try:
        assert _compiled(llm)
        test_lora.run_and_check(llm, tiny_model_dir, PARITY_PROMPTS[:6], loras * 2)
    finally:
        llm.shutdown()


@SLOW
def test_compiled_int_checkpoints_equal_transformers_on_the_dequantized_weights(tmp_path_factory):
    """Integer weights as ops: an AWQ checkpoint (GEMM packing, group 32) and a GPTQ act-order one of the dense
    model, a GPTQ act-order Mixtral (integer experts in the fused MoE op), written by the tests as the tools pack
    them; tokens and logprobs equal transformers' over the dequantized weights."""
    from checkpoints import int4_rtn as ic
    from tests.engine import test_int4_checkpoints, test_moe_int4
    from tests.hf_oracle import assert_matches_hf

    dense = test_int4_checkpoints.int4_factory(tmp_path_factory)
    moe = test_moe_int4.moe_int4_factory(tmp_path_factory)
    formats = [ic.Int4Format("awq", 32), ic.Int4Format("gptq", 32, sym=False, desc_act=True),
               ic.Int4Format("gptq", 32, desc_act=True)]
    cases = [dense(formats[0])[:2], dense(formats[1])[:2], moe("mixtral", formats[2])]
    for fmt, (checkpoint, oracle) in zip(formats, cases):
        outs = test_moe_int4.generate(checkpoint, inspect=lambda llm: _assert(_compiled(llm)), compilation_config=3)
        model = test_moe_int4.hf_model(oracle)
        for out in outs:
            assert len(out.outputs[0].token_ids) == test_moe_int4.MAX_NEW
            assert_matches_hf(model, out, num_top=2, atol=test_moe_int4.act_order_atol(fmt))


def _assert(condition: bool) -> None:
    assert condition


def test_compiled_speculative_decoding_gives_the_plain_output():
    """Speculation with steps launched ahead (device drafts from test_spec_decode's oracle lookup): verify steps
    (1 + k tokens a sequence through the prefill path) and plain steps run the compiled layers, with the plain
    eager output, drafts accepted and rejected."""
    from tests.engine import test_spec_decode as spec

    params = [spec.SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (37, 40, 23, 30)]
    plain, _ = spec._run(spec.PROMPTS, params)
    before = _graphs()
    references = spec._references(spec.PROMPTS, plain)[:3]  # drafts from the oracle: some accepted, some not
    compiled, engine = spec._run(spec.PROMPTS, params, 4, references, True, speculative_config=spec.NGRAM,
                                 compilation_config=3)
    assert 1 <= _graphs() - before <= MAX_GRAPHS  # the layers ran compiled (the engine has shut down)
    spec._assert_same(plain, compiled, atol=1e-4)
    stats = engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


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
    ("deepseek_v2", {"enable_lora": True}, "DeepseekV2ForCausalLM"),
    ("llama", {"enforce_eager": True}, "enforce_eager"),
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
