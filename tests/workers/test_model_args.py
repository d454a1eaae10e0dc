"""ModelArgs: a config.json read once, with transformers' defaults and the derived fields."""

from __future__ import annotations

import pytest

from workers.models.args import ModelArgs

MINIMAL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 1000}


def test_defaults_of_a_minimal_config():
    args = ModelArgs.from_hf_config(MINIMAL)
    assert (args.num_kv_heads, args.head_dim, args.max_position_embeddings) == (4, 16, 2048)
    assert (args.rms_norm_eps, args.rope_theta, args.rope_scaling) == (1e-6, 10000.0, None)
    assert (args.hidden_act, args.initializer_range, args.tie_word_embeddings) == ("silu", 0.02, False)
    assert (args.sliding_window, args.use_sliding_window, args.layer_types) == (None, None, None)
    assert (args.num_experts, args.num_experts_per_tok, args.mlp_only_layers) == (0, 0, ())


def test_head_dim_is_derived_unless_given():
    assert ModelArgs.from_hf_config({**MINIMAL, "num_key_value_heads": 2}).head_dim == 16  # 64 / 4
    args = ModelArgs.from_hf_config({**MINIMAL, "head_dim": 128, "num_key_value_heads": 2})  # Qwen3's habit
    assert (args.head_dim, args.num_heads, args.num_kv_heads) == (128, 4, 2)


@pytest.mark.parametrize("name", ["hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers"])
def test_a_missing_required_field_is_named(name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        ModelArgs.from_hf_config({key: value for key, value in MINIMAL.items() if key != name})


def test_moe_fields():
    qwen = ModelArgs.from_hf_config({**MINIMAL, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                     "norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [0]})
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (4, 2, 32)
    assert (qwen.shared_expert_intermediate_size, qwen.norm_topk_prob) == (48, True)
    assert (qwen.decoder_sparse_step, qwen.mlp_only_layers) == (2, (0,))
    mixtral = ModelArgs.from_hf_config({**MINIMAL, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (8, None)  # experts intermediate_size wide
    with pytest.raises(ValueError, match="'num_experts_per_tok'"):
        ModelArgs.from_hf_config({**MINIMAL, "num_local_experts": 8})
    with pytest.raises(ValueError, match="'moe_intermediate_size'"):
        ModelArgs.from_hf_config({**MINIMAL, "num_experts": 4, "num_experts_per_tok": 2})


@pytest.mark.parametrize("config_class", ["LlamaConfig", "MistralConfig", "Qwen3Config", "Phi3Config",
                                          "MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig"])
def test_agrees_with_transformers_config(config_class):
    """What transformers' own config class makes of a config.json, ModelArgs makes of it too."""
    import transformers

    hf = getattr(transformers, config_class)(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    args = ModelArgs.from_hf_config(hf.to_dict())
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (args.head_dim, args.num_kv_heads, args.rms_norm_eps) == (head_dim, 2, hf.rms_norm_eps)
    assert (args.num_layers, args.vocab_size, args.max_position_embeddings) == (
        hf.num_hidden_layers, hf.vocab_size, hf.max_position_embeddings)
    assert args.num_experts == (getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", 0))
