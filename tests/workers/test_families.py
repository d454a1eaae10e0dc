"""What the families add beyond the Llama layout, against transformers: RoPE scalings whose choice depends on the
sequence length (longrope, dynamic NTK) and YaRN through whole models, sliding windows (every layer, and Qwen's
per-layer rules), in float32 on CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from checkpoints.tiny import make_tiny_model
from tests.workers.test_llama import _hf_logits
from workers.models import get_model_class
from workers.models.args import ModelArgs
from workers.weights import load_model

IDS = [(7 * i + 3) % 900 + 5 for i in range(120)]  # 120 tokens: past every original length below
SHORT_FACTORS = [1.0 + 0.1 * i for i in range(8)]
LONG_FACTORS = [1.0 + 0.7 * i for i in range(8)]


def _build(tmp_path, arch: str, overrides: dict, seed: int = 11) -> tuple[str, dict]:
    path = make_tiny_model(str(tmp_path / arch), arch, seed=seed, config_overrides=overrides)
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)


def _differs_without(cfg: dict, path: str, paged_sequences, logits, ids, **changes) -> bool:
    """Guards a parity test: without the feature under test (`changes` to the config), the model's logits of the
    last token differ by more than the tolerance."""
    plain = load_model({**cfg, **changes}, path, torch.float32, "cpu", max_model_len=len(ids))
    return bool((_prefill_then_decode(paged_sequences, plain, ids)[-1] - logits[-1]).abs().max() > 1e-2)


def _prefill_then_decode(paged_sequences, model, ids: list[int]) -> torch.Tensor:
    seqs = paged_sequences(model, 1, block_size=8)
    return torch.cat([seqs.step([ids[:-1]]), seqs.step([ids[-1:]])])


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    """Phi-3 trained on 64 positions and extended to 2048 (attention factor sqrt(1 + ln 32 / ln 64))."""
    rope = {"rope_type": "longrope", "short_factor": SHORT_FACTORS, "long_factor": LONG_FACTORS, "rope_theta": 1e4}
    return _build(tmp_path_factory.mktemp("phi3"), "phi3",
                  {"original_max_position_embeddings": 64, "rope_parameters": rope})


def test_longrope_long_factors_past_the_original_length(phi3_longrope, paged_sequences):
    path, cfg = phi3_longrope
    model = load_model(cfg, path, torch.float32, "cpu", max_model_len=2048)
    logits = _prefill_then_decode(paged_sequences, model, IDS)  # transformers: long factors (121 > 64 positions)
    torch.testing.assert_close(logits, _hf_logits(path, IDS), atol=1e-4, rtol=1e-4)


def test_longrope_short_factors_within_the_original_length(phi3_longrope, paged_sequences):
    path, cfg = phi3_longrope
    short = load_model(cfg, path, torch.float32, "cpu", max_model_len=64)
    logits = _prefill_then_decode(paged_sequences, short, IDS[:40])
    torch.testing.assert_close(logits, _hf_logits(path, IDS[:40]), atol=1e-4, rtol=1e-4)
    long = load_model(cfg, path, torch.float32, "cpu", max_model_len=2048)
    assert (_prefill_then_decode(paged_sequences, long, IDS[:40]) - logits).abs().max() > 1e-2  # the choice matters


def test_yarn_through_qwen3(tmp_path, paged_sequences):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}
    path, cfg = _build(tmp_path, "qwen3", {"rope_parameters": rope, "max_position_embeddings": 128})
    logits = _prefill_then_decode(paged_sequences, load_model(cfg, path, torch.float32, "cpu"), IDS)
    torch.testing.assert_close(logits, _hf_logits(path, IDS), atol=1e-4, rtol=1e-4)
    assert _differs_without(cfg, path, paged_sequences, logits, IDS, rope_parameters={"rope_theta": 1e6})


def test_dynamic_ntk_is_fixed_at_max_model_len(tmp_path, paged_sequences):
    """transformers rescales per forward pass from its longest position; ours is fixed at max_model_len: the same
    logits for one pass over exactly max_model_len tokens."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    path, cfg = _build(tmp_path, "llama", {"rope_parameters": rope, "max_position_embeddings": 64})
    model = load_model(cfg, path, torch.float32, "cpu", max_model_len=len(IDS))
    logits = paged_sequences(model, 1, block_size=8).step([IDS])
    torch.testing.assert_close(logits, _hf_logits(path, IDS), atol=1e-4, rtol=1e-4)
    plain = load_model({**cfg, "rope_parameters": {"rope_theta": 1e4}}, path, torch.float32, "cpu",
                       max_model_len=len(IDS))
    assert (paged_sequences(plain, 1, block_size=8).step([IDS]) - logits).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["mistral", "phi3", "mixtral"])
def test_sliding_window_every_layer(arch, tmp_path, paged_sequences):
    """A window of 8 under prompts of 30-120 tokens, packed prefill then chunks then decode, as transformers' mask."""
    path, cfg = _build(tmp_path, arch, {"sliding_window": 8})
    model = load_model(cfg, path, torch.float32, "cpu")
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, 8]
    prompts = [IDS[:30], IDS[40:120]]
    seqs = paged_sequences(model, 2, block_size=4, max_blocks=32)
    first = seqs.step([p[:13] for p in prompts])
    seqs.step([p[13:-1] for p in prompts])
    decode = seqs.step([p[-1:] for p in prompts])
    for b, ids in enumerate(prompts):
        expected = _hf_logits(path, ids)
        torch.testing.assert_close(decode[b], expected[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[13:26], _hf_logits(path, prompts[1][:13]), atol=1e-4, rtol=1e-4)
    assert _differs_without(cfg, path, paged_sequences, decode[0:1], prompts[0], sliding_window=None)


def test_qwen2_slides_only_layers_past_max_window_layers(tmp_path, paged_sequences):
    path, cfg = _build(tmp_path, "qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1})
    model = load_model(cfg, path, torch.float32, "cpu")
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 6]
    logits = _prefill_then_decode(paged_sequences, model, IDS[:50])
    torch.testing.assert_close(logits, _hf_logits(path, IDS[:50]), atol=1e-4, rtol=1e-4)
    assert _differs_without(cfg, path, paged_sequences, logits, IDS[:50], use_sliding_window=False)


@pytest.mark.parametrize("config_class,architecture", [("Qwen2Config", "Qwen2ForCausalLM"),
                                                       ("Qwen3Config", "Qwen3ForCausalLM"),
                                                       ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")])
def test_qwen_layer_rules_are_transformers_layer_types(config_class, architecture):
    """An older config.json has no layer_types: each family's rule must give the layers transformers derives."""
    import transformers

    fields = dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=6, max_window_layers=3)
    hf = getattr(transformers, config_class)(**fields)
    expected = [6 if kind == "sliding_attention" else None for kind in hf.layer_types]
    older = {name: value for name, value in hf.to_dict().items() if name != "layer_types"}
    model_class = get_model_class({"architectures": [architecture]})
    assert model_class.layer_windows(ModelArgs.from_hf_config(older)) == expected and None in expected and 6 in expected
    assert model_class.layer_windows(ModelArgs.from_hf_config({**older, "use_sliding_window": False})) == [None] * 6


def test_window_at_least_max_model_len_is_full_attention(tiny_checkpoints):
    path = tiny_checkpoints["mistral"]  # sliding_window 4096
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    windows = [layer.self_attn.attn.sliding_window for layer in load_model(cfg, path, torch.float32, "cpu",
                                                                           max_model_len=4096).model.layers]
    assert windows == [None, None]  # no mask to apply: the kernels' unwindowed path
    model = load_model(cfg, path, torch.float32, "cpu", max_model_len=8192)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [4096, 4096]
