"""DeepSeek-V2 against transformers, in float32 on CPU: MLA without a q LoRA (V2-Lite's shape), with YaRN's mscale
and mscale_all_dim, every layer an MoE; group-limited routing against transformers' router; the latent pool's
layout; DeepSeek's layer rule and the routing options that are refused. (The default tiny deepseek_v2, with a q
LoRA, a dense first layer and group-limited routing, runs in test_llama.py's parity tests of every family.)"""

from __future__ import annotations

import pytest
import torch

from checkpoints.tiny import TINY_ARCHES
from tests.workers.test_families import IDS, _build, _differs_without, _prefill_then_decode
from tests.workers.test_llama import _hf_logits
from workers.kv_pool import KVLayout
from workers.models.args import ModelArgs
from workers.models.deepseek_v2 import DeepseekRouter, is_moe_layer
from workers.weights import load_model

TINY = TINY_ARCHES["deepseek_v2"][2]
LITE = {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def _chunks_then_decode(paged_sequences, model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts packed: a first chunk, the rest but one token (over cached latents), then a decode step.
    Returns (the first chunk's logits, the decode step's)."""
    seqs = paged_sequences(model, len(prompts), block_size=4, max_blocks=32)
    first = seqs.step([p[:5] for p in prompts])
    seqs.step([p[5:-1] for p in prompts])
    return first, seqs.step([p[-1:] for p in prompts])


@pytest.mark.parametrize("overrides", [LITE, {"first_k_dense_replace": 0}], ids=["lite", "every-layer-moe"])
def test_variants_match_transformers(tmp_path, paged_sequences, overrides):
    path, cfg = _build(tmp_path, "deepseek_v2", overrides, seed=5)
    model = load_model(cfg, path, torch.float32, "cpu")
    layers = model.model.layers
    assert hasattr(layers[0].self_attn, "q_proj") != (overrides.get("q_lora_rank", 1) is not None)
    assert [is_moe_layer(model.args, i) for i in range(2)] == [overrides.get("first_k_dense_replace") == 0, True]
    prompts = [IDS[:30], IDS[40:90]]
    first, decode = _chunks_then_decode(paged_sequences, model, prompts)
    torch.testing.assert_close(first[:5], _hf_logits(path, prompts[0][:5]), atol=1e-4, rtol=1e-4)
    for b, ids in enumerate(prompts):
        torch.testing.assert_close(decode[b], _hf_logits(path, ids)[-1], atol=1e-4, rtol=1e-4)


def test_yarn_with_mscale_matches_transformers(tmp_path, paged_sequences):
    """YaRN over the 8 rope dims, trained on 32 positions and run on 120: the cos/sin factor mscale / mscale_all_dim
    and the softmax scale's mscale_all_dim^2 both apply (the guard: without the scaling, other logits)."""
    path, cfg = _build(tmp_path, "deepseek_v2", {"rope_parameters": YARN, "max_position_embeddings": 128})
    model = load_model(cfg, path, torch.float32, "cpu")
    assert model.model.layers[0].self_attn.attn.scale != (16 + 8) ** -0.5
    logits = _prefill_then_decode(paged_sequences, model, IDS)
    torch.testing.assert_close(logits, _hf_logits(path, IDS), atol=1e-4, rtol=1e-4)
    assert _differs_without(cfg, path, paged_sequences, logits, IDS, rope_parameters={"rope_theta": 1e4})


def test_latent_pool_layout(tiny_checkpoints):
    import json
    import os

    path = tiny_checkpoints["deepseek_v2"]
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    model = load_model(cfg, path, torch.float32, "cpu")
    assert model.kv_layout == KVLayout.latent(2, 32, 8)  # kv_lora_rank, qk_rope_head_dim
    # 40 values a token and layer, against per-head K and V of 4 heads x 24 (qk) + 4 x 16 (v) = 160 expanded
    assert model.kv_layout.bytes_per_token(torch.bfloat16) == 2 * (32 + 8) * 2


def _hf_router(overrides: dict):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(**{**TINY, "hidden_size": 64, "num_attention_heads": 4, **overrides})
    return config, DeepseekV2TopkRouter(config)


def _route(router, h) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of each token, its experts in id order (transformers' router returns its logits first)."""
    weights, ids = router(h)[-2:]
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("overrides", [{}, {"topk_method": "greedy"}, {"num_experts_per_tok": 2, "topk_group": 1}],
                         ids=["top-3-of-2-groups", "greedy", "top-2-of-1-group"])
def test_routing_is_transformers_router(overrides):
    config, hf = _hf_router(overrides)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=generator))
    ours = DeepseekRouter(ModelArgs.from_hf_config(config.to_dict()))
    ours.weight.data.copy_(hf.weight)
    h = torch.randn(64, 64, generator=generator)
    with torch.no_grad():
        expected = _route(hf, h)
    got = _route(ours, h)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    if not overrides:  # the guard: limiting the groups changes some tokens' experts here (3 experts, 2 groups)
        greedy = DeepseekRouter(ModelArgs.from_hf_config({**config.to_dict(), "topk_method": "greedy"}))
        greedy.weight.data.copy_(hf.weight)
        assert not torch.equal(_route(greedy, h)[1], got[1])


def test_norm_topk_prob_renormalizes_without_the_scaling_factor():
    """DeepSeek's own modeling code (transformers ignores norm_topk_prob): top-k weights / their sum (+ 1e-20)
    when top_k > 1, else times routed_scaling_factor."""
    config, _ = _hf_router({"norm_topk_prob": True, "topk_method": "greedy"})
    router = DeepseekRouter(ModelArgs.from_hf_config(config.to_dict()))
    router.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    weights, ids = router(h)
    probs = (h @ router.weight.T).softmax(-1)
    torch.testing.assert_close(weights, probs.gather(1, ids) / probs.gather(1, ids).sum(-1, keepdim=True))
    one = DeepseekRouter(ModelArgs.from_hf_config({**config.to_dict(), "num_experts_per_tok": 1}))
    one.weight.data.copy_(router.weight)
    torch.testing.assert_close(one(h)[0], probs.max(-1, keepdim=True).values * 1.5)


def test_moe_layer_rule():
    args = ModelArgs.from_hf_config({**_hf_router({})[0].to_dict(), "num_hidden_layers": 6,
                                     "first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert [is_moe_layer(args, i) for i in range(6)] == [False, False, True, False, True, False]


@pytest.mark.parametrize("field, value", [("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")])
def test_unsupported_routing_is_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} '{value}' is not supported"):
        ModelArgs.from_hf_config({**_hf_router({})[0].to_dict(), field: value})


def test_group_settings_are_checked():
    config, _ = _hf_router({"n_group": 3})  # 8 experts in 3 groups
    with pytest.raises(ValueError, match="n_group 3 must divide n_routed_experts 8"):
        DeepseekRouter(ModelArgs.from_hf_config(config.to_dict()))
