"""The tiny checkpoint: deterministic files, a real tokenizer with a chat template, a cached default copy."""

from __future__ import annotations

import json
import os
import threading

from transformers import AutoTokenizer

from checkpoints import tiny
from checkpoints.tiny import default_tiny_model_path, make_tiny_model


def _read(path: str, name: str) -> bytes:
    with open(os.path.join(path, name), "rb") as f:
        return f.read()


def test_build_is_deterministic(tmp_path):
    a = make_tiny_model(str(tmp_path / "a"), "qwen2", seed=0)
    b = make_tiny_model(str(tmp_path / "b"), "qwen2", seed=0)
    c = make_tiny_model(str(tmp_path / "c"), "qwen2", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert _read(a, name) == _read(b, name), name
    assert _read(a, "model.safetensors") != _read(c, "model.safetensors")
    assert _read(a, "tokenizer.json") == _read(c, "tokenizer.json")


def test_tokenizer_loads_and_matches_the_config(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = json.loads(_read(path, "config.json"))
    assert len(tokenizer) == config["vocab_size"] == 1000
    assert tokenizer.bos_token_id == config["bos_token_id"]
    assert tokenizer.eos_token_id in config["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in config["eos_token_id"]
    assert tokenizer.pad_token_id == config["pad_token_id"]
    text = "Hello, world! Ünïcode ✓ works too."
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) < len(text)  # merges happen
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless


def test_chat_template_renders(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(str(tmp_path / "m"), "llama"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids


def test_default_path_builds_once_even_when_racing(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    calls = []
    real_make = tiny.make_tiny_model
    monkeypatch.setattr(tiny, "make_tiny_model", lambda *a, **k: calls.append(1) or real_make(*a, **k))
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(default_tiny_model_path())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = str(tmp_path / "tiny-llama-v1")
    assert paths == [expected, expected]
    assert sorted(os.listdir(tmp_path)) == ["tiny-llama-v1"]  # no temporary directory left behind
    assert default_tiny_model_path() == expected and len(calls) <= 2
    assert os.path.isfile(os.path.join(expected, "model.safetensors"))


def test_cli_offers_every_tiny_arch(tmp_path):
    from deploy.cli import TINY_ARCH_NAMES, main

    assert TINY_ARCH_NAMES == list(tiny.TINY_ARCHES)
    assert main(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3_moe"]) == 0
    config = json.loads(_read(str(tmp_path / "m"), "config.json"))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["mlp_only_layers"] == [0]
