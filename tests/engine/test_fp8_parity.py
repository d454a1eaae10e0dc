"""FP8 end to end on CPU: LLM(quantization="fp8", kv_cache_dtype="fp8") gives transformers' greedy tokens when
transformers computes the same definitions (tests/fp8_oracle.py: fake-quantized weights, per-token activations,
K/V), under block sizes, preemption, chunked prefill and prefix caching; FP8 checkpoints in the formats people
have load and match the oracle built from their dequantized tensors; unsupported configs are clear errors.

Logprobs agree to 5e-3, not 1e-4 as unquantized: two float32 computations of the same activation that differ in
the last bit can round to neighbouring e4m3 values (1 in ~16,000 elements), which moves a logit by ~1e-3.
"""

import functools
import json
import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests import fp8_oracle
from tests.prompts import PARITY_PROMPTS

MAX_NEW = 10
PROMPTS = PARITY_PROMPTS
LOGPROB_TOL = 5e-3


@functools.lru_cache(maxsize=None)
def prompt_ids(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.encode(p) for p in PROMPTS]


@functools.lru_cache(maxsize=None)
def oracle(model_dir: str, tp: int = 1, kv_fp8: bool = True):
    model = fp8_oracle.oracle_model(model_dir, tp=tp, kv_fp8=kv_fp8)
    return fp8_oracle.greedy(model, prompt_ids(model_dir), MAX_NEW)


def run(model_dir, quantization="fp8", kv_cache_dtype="fp8", tokenizer_dir=None, **kwargs):
    kwargs.setdefault("num_kv_blocks", 512)  # not the 1 GiB default: millions of tiny FP8 blocks take seconds
    llm = LLM(model=model_dir, dtype="float32", device="cpu", quantization=quantization,
              kv_cache_dtype=kv_cache_dtype, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2)
    ids = prompt_ids(tokenizer_dir or model_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    llm.engine.check_integrity()
    return llm, outs


def assert_matches(reference, outs):
    for (ref_tokens, ref_logprobs), out in zip(reference, outs):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {out.prompt_token_ids[:6]}..."
        for step, (token_id, entry) in enumerate(zip(ref_tokens, completion.logprobs)):
            assert abs(entry[token_id] - ref_logprobs[step][token_id].item()) < LOGPROB_TOL, step


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "mixtral"])
def test_fp8_weights_and_kv_match_the_oracle(tiny_checkpoints, arch):
    """Every family's linear layers: Qwen3's head norms, Phi-3's fused checkpoint tensors, Mixtral's attention
    and routed experts (FP8 weights, inputs quantized per token: in the oracle too; more in test_moe_fp8.py)."""
    model_dir = tiny_checkpoints[arch]
    llm, outs = run(model_dir)
    assert_matches(oracle(model_dir), outs)
    (worker,) = llm.engine.executor.describe()
    assert worker["kv_cache_dtype"] == "float8_e4m3fn"
    layer = llm.engine.executor.worker.model.model.layers[0]
    assert layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    if arch == "mixtral":
        assert layer.mlp.experts.w13_weight.dtype == layer.mlp.experts.w2_weight.dtype == torch.float8_e4m3fn
    else:
        assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("arch, overrides, seed", [("mistral", {"sliding_window": 8}, 2), ("qwen2_moe", {}, 0)],
                         ids=["mistral-window-8", "qwen2_moe-shared-expert"])
def test_fp8_with_sliding_windows_and_a_shared_expert(tmp_path, arch, overrides, seed):
    """A window of 8 under prompts longer than it (the attention kernels with a window and KV scales at once), and
    Qwen2-MoE's FP8 shared expert, whose partial sum joins the FP8 experts' before the one all-reduce.

    Seeds: with some (Mistral's 1) a single activation of one prompt lands where the two float32 computations round
    it to neighbouring e4m3 values and a logprob moves by 0.04 (same tokens); these seeds have no such element."""
    from checkpoints.tiny import make_tiny_model

    model_dir = make_tiny_model(str(tmp_path / arch), arch=arch, seed=seed, config_overrides=overrides)
    llm, outs = run(model_dir)
    assert_matches(oracle(model_dir), outs)
    model = llm.engine.executor.worker.model
    if arch == "mistral":
        assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, 8]
        assert max(len(ids) for ids in prompt_ids(model_dir)) > 8
    else:
        assert model.model.layers[0].mlp.shared_expert.down_proj.weight.dtype == torch.float8_e4m3fn


def test_fp8_weights_alone_and_the_oracle_is_sharp(tiny_checkpoints):
    """Weights in FP8, KV in float32; and the oracle tells the FP8 paths apart (a test that can fail)."""
    model_dir = tiny_checkpoints["llama"]
    _, outs = run(model_dir, kv_cache_dtype="auto")
    assert_matches(oracle(model_dir, kv_fp8=False), outs)
    with pytest.raises(AssertionError):  # FP8 KV is a different computation
        assert_matches(oracle(model_dir, kv_fp8=True), outs)


def test_fp8_kv_doubles_the_blocks_of_a_bf16_pool(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    blocks = {kv: LLM(model=model_dir, dtype="bfloat16", device="cpu", kv_cache_dtype=kv,
                      cpu_kv_cache_bytes=4 << 20).engine.executor.num_kv_blocks for kv in ("auto", "fp8")}
    assert blocks["fp8"] == 2 * blocks["auto"]


@pytest.mark.parametrize("kwargs", [dict(block_size=1, num_kv_blocks=2048), dict(block_size=4, num_kv_blocks=24),
                                    dict(block_size=4, max_num_batched_tokens=7)],
                         ids=["block-1", "preemption", "chunked-prefill"])
def test_fp8_parity_across_scheduling(tiny_checkpoints, kwargs):
    model_dir = tiny_checkpoints["llama"]
    llm, outs = run(model_dir, **kwargs)
    if kwargs.get("num_kv_blocks") == 24:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_matches(oracle(model_dir), outs)


def test_fp8_parity_with_prefix_cache_hits(tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    llm, outs = run(model_dir, block_size=4, max_num_seqs=1)
    assert llm.engine.block_manager.prefix_hits_tokens > 0
    assert_matches(oracle(model_dir), outs)


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    checkpoints = {}

    def checkpoint(arch: str, fmt: str):
        if (arch, fmt) not in checkpoints:
            checkpoints[arch, fmt] = fp8_oracle.write_fp8_checkpoint(tiny_checkpoints[arch], str(root / arch / fmt),
                                                                     fmt)
        return checkpoints[arch, fmt]

    return checkpoint


@pytest.mark.parametrize("arch, fmt", [("llama", "fp8-tensor"), ("llama", "fp8-block"), ("llama", "ct-channel"),
                                       ("llama", "ct-static"), ("phi3", "fp8-block"), ("phi3", "ct-channel"),
                                       ("phi3", "ct-static")])
def test_fp8_checkpoints_match_their_dequantized_oracle(fp8_checkpoints, tiny_checkpoints, arch, fmt):
    """Phi-3's fused qkv_proj / gate_up_proj: their scales (per row, per block, per tensor) and static input
    scales split into the parts as the weights are."""
    model_dir, weights, input_scales = fp8_checkpoints(arch, fmt)
    model = fp8_oracle.oracle_model(tiny_checkpoints[arch], weights=weights, input_scales=input_scales,
                                    kv_fp8=False)
    reference = fp8_oracle.greedy(model, prompt_ids(model_dir), MAX_NEW)
    llm, outs = run(model_dir, quantization=None, kv_cache_dtype="auto")  # the checkpoint says FP8
    assert_matches(reference, outs)
    layer = llm.engine.executor.worker.model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert (layer.mlp.gate_up_proj.input_scale is not None) == (fmt == "ct-static")


def _with_quantization_config(src: str, dst, qc: dict) -> str:
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": qc}, f)
    return str(dst)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits 3 is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "awq version 'gemv' is not supported"),  # the rest: test_int4_*
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "format 'int-quantized'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.down_proj"]},
     "leaving decoder modules unquantized"),
])
def test_unsupported_quantization_configs_fail_at_load(tiny_checkpoints, tmp_path, qc, message):
    model_dir = _with_quantization_config(tiny_checkpoints["llama"], tmp_path / "ckpt", qc)
    with pytest.raises(ValueError, match=message):
        LLM(model=model_dir, device="cpu")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model=tiny_checkpoints["llama"], device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(model=tiny_checkpoints["llama"], device="cpu", kv_cache_dtype="int8")


def test_online_fp8_of_an_fp8_checkpoint_is_the_checkpoint(fp8_checkpoints):
    """quantization="fp8" on a checkpoint that is FP8 already uses the checkpoint's own scales."""
    model_dir, _, _ = fp8_checkpoints("llama", "ct-channel")
    _, a = run(model_dir, quantization="fp8", kv_cache_dtype="auto")
    _, b = run(model_dir, quantization=None, kv_cache_dtype="auto")
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_fp8_of_a_gguf_file_quantizes_its_dequantized_tensors(tiny_checkpoints, tmp_path):
    """quantization="fp8" on a GGUF file: each rank quantizes the dequantized slices online (an F32 GGUF holds the
    checkpoint's exact values, so the checkpoint's oracle applies)."""
    from tests.gguf_files import write_gguf

    model_dir = tiny_checkpoints["llama"]
    path = write_gguf(model_dir, str(tmp_path / "tiny-llama.F32.gguf"), qtype="F32")
    llm, outs = run(path, tokenizer_dir=model_dir)
    assert_matches(oracle(model_dir), outs)
    assert llm.engine.executor.worker.model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
