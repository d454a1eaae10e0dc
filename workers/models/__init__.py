"""Model registry: Hugging Face `architectures` name -> model class (imported on first use)."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("workers.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("workers.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("workers.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("workers.models.qwen", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("workers.models.phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("workers.models.moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("workers.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("workers.models.moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("workers.models.deepseek_v2", "DeepseekV2ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: dict) -> type:
    """The class for a config.json dict, from its first supported entry in `architectures`."""
    architectures = hf_config.get("architectures") or []
    for arch in architectures:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported model architectures {architectures}; supported: {supported_architectures()}")
