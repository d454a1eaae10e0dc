"""Parity of the paged models of every family with Hugging Face transformers (the oracle), in float32 on CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoints.tiny import TINY_ARCHES, make_tiny_model
from workers.models import get_model_class, supported_architectures
from workers.models.args import rope_settings
from workers.models.llama import LlamaForCausalLM
from workers.weights import load_model

PROMPTS = [
    "Hello, world! How are you today?",
    "The cache is split into blocks of a fixed size.",
    "def fibonacci(n: int) -> list[int]:\n    numbers = [0, 1]",
]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    """tests/conftest.py's checkpoint of every family, plus a Llama 3.1-style rope_scaling one."""
    path = str(tmp_path_factory.mktemp("tiny") / "llama3_rope")
    rope = make_tiny_model(path, "llama", seed=7, config_overrides={"rope_parameters": LLAMA3_ROPE})
    return {**tiny_checkpoints, "llama3_rope": rope}


def _load_ours(path: str):
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    return load_model(hf_config, path, torch.float32, "cpu")


def _hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()  # [L, vocab]


def _prompt_ids(path: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.mark.parametrize("arch", [*TINY_ARCHES, "llama3_rope"])
def test_packed_prefill_matches_hf(checkpoints, paged_sequences, arch):
    path = checkpoints[arch]
    model, prompts = _load_ours(path), _prompt_ids(path)
    seqs = paged_sequences(model, num_seqs=len(prompts))
    logits = seqs.step(prompts)  # all prompts packed into one prefill
    offset = 0
    for ids in prompts:
        expected = _hf_logits(path, ids)
        torch.testing.assert_close(logits[offset:offset + len(ids)], expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits[offset:offset + len(ids)].argmax(-1), expected.argmax(-1))
        offset += len(ids)


@pytest.mark.parametrize("arch", list(TINY_ARCHES))
def test_chunked_prefill_then_decode_matches_hf(checkpoints, paged_sequences, arch):
    """Prefill in two chunks (the second attends to cached KV), then one decode step per sequence."""
    path = checkpoints[arch]
    model, prompts = _load_ours(path), _prompt_ids(path)
    seqs = paged_sequences(model, num_seqs=len(prompts))
    seqs.step([ids[:3] for ids in prompts])
    seqs.step([ids[3:-1] for ids in prompts])
    decode_logits = seqs.step([ids[-1:] for ids in prompts])  # is_decode_only
    for b, ids in enumerate(prompts):
        torch.testing.assert_close(decode_logits[b], _hf_logits(path, ids)[-1], atol=1e-4, rtol=1e-4)


def test_decode_with_some_sequences_idle(checkpoints, paged_sequences):
    path = checkpoints["llama"]
    model, prompts = _load_ours(path), _prompt_ids(path)
    seqs = paged_sequences(model, num_seqs=len(prompts))
    seqs.step([ids[:-1] for ids in prompts])
    logits = seqs.step([[], prompts[1][-1:], []])
    torch.testing.assert_close(logits[0], _hf_logits(path, prompts[1])[-1], atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_applied(checkpoints, paged_sequences):
    """Guards the parity test above: ignoring rope_scaling would change the logits well beyond its tolerance."""
    path = checkpoints["llama3_rope"]
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    plain_config = {**hf_config, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    ids = list(range(5, 125))
    scaled = paged_sequences(load_model(hf_config, path, torch.float32, "cpu"), 1, block_size=8).step([ids])
    plain = paged_sequences(load_model(plain_config, path, torch.float32, "cpu"), 1, block_size=8).step([ids])
    torch.testing.assert_close(scaled, _hf_logits(path, ids), atol=1e-4, rtol=1e-4)
    assert (scaled - plain).abs().max() > 1e-2


def test_model_properties(checkpoints):
    model = _load_ours(checkpoints["qwen2"])
    assert (model.num_layers, model.num_kv_heads_per_rank, model.head_dim, model.vocab_size) == (2, 2, 16, 1000)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None


def test_rope_settings_reads_old_and_new_configs():
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0}, "max_position_embeddings": 4096}
    assert rope_settings(old) == (500000.0, {"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 4096})  # transformers' default
    phi3 = {"model_type": "phi3", "original_max_position_embeddings": 4096, "max_position_embeddings": 131072,
            "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0],
                             "original_max_position_embeddings": 2048}}
    assert rope_settings(phi3)[1] == {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                                      "original_max_position_embeddings": 4096}  # the top-level field wins
    assert rope_settings({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 1.0},
                          "max_position_embeddings": 32768})[1]["original_max_position_embeddings"] == 32768
    with pytest.raises(NotImplementedError, match="partial_rotary_factor 0.75"):
        rope_settings({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}})
    assert rope_settings({"rope_parameters": LLAMA3_ROPE})[1]["rope_type"] == "llama3"
    assert rope_settings({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (1e6, None)
    assert rope_settings({}) == (10000.0, None)


def test_registry():
    assert get_model_class({"architectures": ["MistralForCausalLM"]}) is LlamaForCausalLM
    for _, architecture, _ in TINY_ARCHES.values():
        assert get_model_class({"architectures": [architecture]}).__name__ == architecture.replace("Mistral", "Llama")
    assert len(supported_architectures()) == len(TINY_ARCHES)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class({"architectures": ["GPT2LMHeadModel"]})
