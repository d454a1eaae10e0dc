"""FP8 routed experts. quantization="fp8" on Mixtral / Qwen-MoE quantizes the experts with every other linear, a scale
per output row (test_fp8_parity.py's Mixtral and Qwen2-MoE cases); FP8 MoE checkpoints load as stored, their experts
included: transformers' fp8 with weight_block_size [128, 128] (Qwen3-30B-A3B-FP8 / DeepSeek style, whose
modules_to_not_convert names every layer's norms and router) or [16, 32], or a scale per tensor, and
compressed-tensors per channel, or per tensor with static input scales (an input scale per expert projection in the
checkpoint; one per layer for all experts' gate / up and one for their down in Pagoda and the oracle: the largest,
rounded up to a power of two). FP8 experts are W8A8: each GEMM's input is quantized per token (or by the static
scale), in the oracle too.

The oracle is tests/fp8_oracle.py's transformers model carrying the checkpoint's dequantized weights (its attention
and shared-expert linears quantizing their inputs per token, as Pagoda's do; its experts computing as transformers'
loop does, their inputs quantized per token), against greedy tokens and logprobs (5e-3, test_fp8_parity.py says why).
"""

import json
import os

import pytest
import torch

from tests import fp8_oracle
from tests.engine.test_fp8_parity import MAX_NEW, assert_matches, prompt_ids, run


def _set_ignored(model_dir: str, field: str, names: list[str]) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"][field] = names
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


# what the producing tools write beside the tensors
IGNORED = {"fp8-block128": ("modules_to_not_convert", ["lm_head"] + [
               f"model.layers.{i}.{m}" for i in range(2) for m in ("input_layernorm", "mlp.gate",
                                                                   "post_attention_layernorm")]),
           "ct-channel": ("ignore", ["lm_head", "re:.*block_sparse_moe.gate$"])}


# [128, 128] blocks: q/k/v and the dense layer's gate/up rows in whole blocks (Pagoda's fused dense FP8 layers need
# them, as the real Qwen3-30B-A3B's have them); the experts' 160 rows / columns one whole block and a partial one,
# over a hidden size of two blocks
BLOCK128 = {"hidden_size": 256, "head_dim": 128, "intermediate_size": 128, "moe_intermediate_size": 160}


@pytest.mark.parametrize("arch, fmt, overrides", [("qwen3_moe", "fp8-block128", BLOCK128),
                                                  ("qwen3_moe", "fp8-block", None), ("mixtral", "ct-channel", None),
                                                  ("qwen2_moe", "fp8-tensor", None), ("mixtral", "ct-static", None),
                                                  ("qwen2_moe", "ct-static", None),
                                                  ("qwen3_moe", "fp8-static", None)],
                         ids=["qwen3_moe-block128", "qwen3_moe-block16x32", "mixtral-ct-channel", "qwen2_moe-tensor",
                              "mixtral-ct-static", "qwen2_moe-ct-static", "qwen3_moe-autofp8-static"])
def test_fp8_moe_checkpoints_match_their_dequantized_oracle(tiny_checkpoints, tmp_path, arch, fmt, overrides):
    """Qwen3-MoE's dense layer 0 and 6 experts (128 x 128 blocks, and 2 x 2 blocks of 16 x 32 per gate / up),
    Mixtral's per-channel experts, Qwen2-MoE's shared expert and its per-tensor scales; static input scales on
    Mixtral's experts and on Qwen2-MoE's experts and shared expert (compressed-tensors), on Qwen3-MoE's (AutoFP8's
quant_method fp8 with activation_scheme static)."""
    from checkpoints.tiny import make_tiny_model

    src = (make_tiny_model(str(tmp_path / "float"), arch, seed=6, config_overrides=overrides) if overrides
           else tiny_checkpoints[arch])
    model_dir, weights, input_scales = fp8_oracle.write_fp8_checkpoint(src, str(tmp_path / fmt), fmt)
    if fmt in IGNORED:
        _set_ignored(model_dir, *IGNORED[fmt])
    reference = fp8_oracle.greedy(fp8_oracle.oracle_model(src, weights=weights, input_scales=input_scales,
                                                          kv_fp8=False), prompt_ids(model_dir), MAX_NEW)
    llm, outs = run(model_dir, quantization=None, kv_cache_dtype="auto")  # the checkpoint says FP8
    assert_matches(reference, outs)
    experts = llm.engine.executor.worker.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn
    if fmt.startswith("fp8-block"):
        bn, bk = fp8_oracle.BLOCKS[fmt]
        inter, hidden = experts.inter_per_rank, experts.hidden_size
        assert experts.w13_weight_scale.shape == (experts.num_experts, 2 * -(-inter // bn), -(-hidden // bk))
    if fmt.endswith("-static"):  # one scale for all experts: the largest of the checkpoint's, a power of two
        for proj, names in (("w13", ("w1", "gate_proj", "w3", "up_proj")), ("w2", ("w2", "down_proj"))):
            raw = [v for m, v in _raw_input_scales(model_dir).items()
                   if ".layers.1." in m and ".experts." in m and m.rsplit(".", 1)[1] in names]
            assert len(raw) == experts.num_experts * (2 if proj == "w13" else 1)
            expected = fp8_oracle.pow2_at_least(torch.tensor(max(raw)), 1.0).item()
            assert getattr(experts, f"{proj}_input_scale").item() == expected


def test_the_oracle_tells_fp8_experts_apart(tiny_checkpoints):
    """Online FP8 experts match the oracle's, and not unquantized ones: the tests here and test_fp8_parity's MoE
    cases could fail."""
    model_dir = tiny_checkpoints["qwen3_moe"]
    _, outs = run(model_dir, kv_cache_dtype="auto")
    ids = prompt_ids(model_dir)
    assert_matches(fp8_oracle.greedy(fp8_oracle.oracle_model(model_dir, kv_fp8=False), ids, MAX_NEW), outs)
    float_experts = fp8_oracle.oracle_model(model_dir, kv_fp8=False, fp8_experts=False)
    with pytest.raises(AssertionError):
        assert_matches(fp8_oracle.greedy(float_experts, ids, MAX_NEW), outs)


def test_random_fp8_experts(tiny_checkpoints):
    """load_format="random" with quantization="fp8" (the presets' path): experts drawn in FP8 per row, the
    initializer's standard deviation (0.3), and the model generates."""
    from workers.layers.moe_quant import quantized_experts

    llm, _ = run(tiny_checkpoints["mixtral"], load_format="random", kv_cache_dtype="auto")
    experts = llm.engine.executor.worker.model.model.layers[0].mlp.experts
    for projection in quantized_experts(experts):
        w = torch.stack([projection.dequantize(e, torch.float32) for e in range(projection.num_experts)])
        assert projection.weight.dtype == torch.float8_e4m3fn and abs(w.std().item() - 0.3) < 0.02


def _raw_input_scales(model_dir: str) -> dict:
    """The checkpoint's input_scale tensors by module name."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    return {n.rsplit(".", 1)[0]: t.item() for n, t in tensors.items() if n.endswith(".input_scale")}


def test_the_oracle_tells_static_expert_scales_apart(tiny_checkpoints, tmp_path):
    """A static-scale checkpoint's experts match the oracle with its static scales, and not the oracle whose
    experts quantize per token: the static cases above could fail."""
    src = tiny_checkpoints["mixtral"]
    model_dir, weights, input_scales = fp8_oracle.write_fp8_checkpoint(src, str(tmp_path / "static"), "ct-static")
    _, outs = run(model_dir, quantization=None, kv_cache_dtype="auto")
    ids = prompt_ids(model_dir)
    per_token_experts = {m: v for m, v in input_scales.items() if ".experts." not in m}
    with pytest.raises(AssertionError):
        assert_matches(fp8_oracle.greedy(fp8_oracle.oracle_model(src, weights=weights, input_scales=per_token_experts,
                                                                 kv_fp8=False), ids, MAX_NEW), outs)
