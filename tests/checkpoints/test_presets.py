"""The real-sized presets build the model they name: each family's class on the meta device (no memory), with
the published parameter counts."""

import pytest
import torch

from checkpoints.presets import PRESETS
from workers.models import get_model_class
from workers.models.args import ModelArgs

PARAMETERS = {"llama-3-8b": 8.03e9, "llama-3.1-8b": 8.03e9, "qwen2.5-7b": 7.62e9, "llama-3-70b": 70.6e9,
              "mixtral-8x7b": 46.7e9, "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.5e9, "deepseek-v2-lite": 15.7e9,
              "deepseek-v2": 235.7e9, "smollm2-135m": 134.5e6}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_its_family_at_its_size(name):
    cfg = PRESETS[name]
    model = get_model_class(cfg)(ModelArgs.from_hf_config(cfg), torch.bfloat16, "meta", max_model_len=4096)
    assert type(model).__name__ == cfg["architectures"][0]
    num_params = sum(p.numel() for p in model.parameters())
    assert abs(num_params / PARAMETERS[name] - 1) < 0.005, f"{name}: {num_params / 1e9:.2f}B"


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("quantization, bytes_per_weight", [("fp8", (1.0, 1.005)), ("awq", (0.5195, 0.5196)),
                                                            ("gptq", (0.5195, 0.5225))])  # + an int32 g_idx per input
def test_moe_presets_build_with_quantized_experts(name, quantization, bytes_per_weight):
    """`pagoda bench ... --preset <MoE> --quantization fp8` holds FP8 experts (1 byte a weight and a float32 scale a
    row; random weights drawn in FP8: tests/engine/test_moe_fp8.py), `--quantization awq` / `gptq` int4 ones in the
    default random layout (engine/quantization.py RANDOM_INT_CONFIGS: half a byte, and an fp16 scale and a 4-bit
    zero per 128; drawn packed: tests/engine/test_moe_int4.py); on the meta device, the whole model well inside one
    H200."""
    from engine.quantization import resolve_quantization
    from workers.layers.moe import FusedMoE
    from workers.layers.quantization import quantized_layers

    cfg = PRESETS[name]
    with quantized_layers(resolve_quantization(quantization, cfg, is_random_weights=True)):
        model = get_model_class(cfg)(ModelArgs.from_hf_config(cfg), torch.bfloat16, "meta", max_model_len=4096)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == cfg["num_hidden_layers"]
    if quantization == "fp8":
        assert all(e.w13_weight.dtype == e.w2_weight.dtype == torch.float8_e4m3fn for e in experts)
    else:
        assert all(e.w13_qweight.dtype == torch.int32 for e in experts)
    weights = sum(3 * e.num_experts * e.hidden_size * e.intermediate_size for e in experts)
    expert_bytes = sum(t.numel() * t.element_size() for e in experts for t in [*e.parameters(), *e.buffers()])
    low, high = bytes_per_weight
    assert low <= expert_bytes / weights <= high, expert_bytes / weights
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert size < 0.55 * PARAMETERS[name] * 2, f"{size / 2**30:.1f} GiB"  # under 55% of the bf16 weights
