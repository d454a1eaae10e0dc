"""Real-sized model shapes with random weights (`--load-format random`): a config.json and the tiny model's
tokenizer in a cached directory. Nothing is downloaded; the weights are drawn on the device at load time."""

from __future__ import annotations

import json
import os
import shutil

from checkpoints.source import cache_root

_COMMON = {"hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initializer_range": 0.02}
_LLAMA_3 = {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "bos_token_id": 128000, "eos_token_id": 128001}

_QWEN_3 = {**_COMMON, "num_attention_heads": 32, "head_dim": 128, "vocab_size": 151936,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
           "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645}

# DeepSeek-V2's published configs: MLA (kv_lora_rank 512 + 64 rope dims a token and layer in the pool), YaRN to
# 160k positions, a dense first layer, then 2 shared + 6 routed experts a token
_DEEPSEEK_V2 = {**_COMMON, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                "norm_topk_prob": False, "scoring_func": "softmax", "attention_bias": False, "vocab_size": 102400,
                "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                "bos_token_id": 100000, "eos_token_id": 100001}

PRESETS = {
    # the built-in model's shape (135M parameters: a host-bound step on a GPU), its tied embeddings
    "smollm2-135m": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
                     "eos_token_id": 2},
    "llama-3-8b": {**_LLAMA_3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32},
    # Llama 3.1's long context: 128k positions through its "llama3" RoPE scaling (histories of 8-16k tokens and more)
    "llama-3.1-8b": {**_LLAMA_3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "max_position_embeddings": 131072,
                     "eos_token_id": [128001, 128008, 128009],
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen2.5-7b": {
        **_COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "llama-3-70b": {**_LLAMA_3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64},
    # 46.7B parameters (93 GB in bf16: one H200), 12.9B active per token: 2 of 8 experts
    "mixtral-8x7b": {
        **_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3-8b": {**_QWEN_3, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_key_value_heads": 8},
    # 30.5B parameters, 3.3B active: 8 of 128 experts of 768 rows
    "qwen3-30b-a3b": {**_QWEN_3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "num_hidden_layers": 48, "num_key_value_heads": 4},
    # 15.7B parameters, 2.4B active: 6 of 64 experts of 1408 rows (+ 2 shared), 16 heads, no q LoRA
    "deepseek-v2-lite": {**_DEEPSEEK_V2, "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
                         "moe_intermediate_size": 1408, "n_routed_experts": 64, "topk_method": "greedy",
                         "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
    # 236B parameters (472 GB in bf16: tensor parallel over 8 H200s), 21B active: 6 of 160 experts of 1536 rows from
    # the best 3 of 8 groups (+ 2 shared), 128 heads with a 1536-rank q LoRA
    "deepseek-v2": {**_DEEPSEEK_V2, "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 60,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
                    "moe_intermediate_size": 1536, "n_routed_experts": 160, "topk_method": "group_limited_greedy",
                    "n_group": 8, "topk_group": 3, "routed_scaling_factor": 16.0},
}


def preset_dir(name: str) -> str:
    """A checkpoint directory for a preset (config.json + the tiny tokenizer), created once in the cache."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    from checkpoints.tiny import default_tiny_model_path  # lazy: it imports torch, the presets' callers need not

    path = os.path.join(cache_root(), "presets", name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(PRESETS[name], f, indent=2)
    tiny = default_tiny_model_path()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny, file), os.path.join(path, file))
    return path


def model_or_preset(model: str | None, preset: str | None, load_format: str = "auto") -> tuple[str | None, str]:
    """(model dir, load_format): a preset means random weights; a model, `load_format` (its own, or "random")."""
    if preset:
        return preset_dir(preset), "random"
    return model, load_format
