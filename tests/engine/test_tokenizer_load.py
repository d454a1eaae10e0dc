"""The tokenizer's load (engine/tokenizer.py): where tokenizer_config.json names its class, Pagoda gives AutoTokenizer
a plain config carrying the model type instead of letting it import the model's config class (which imports much of
transformers' modelling code). The oracle is AutoTokenizer's own path: the same class, the same token ids, the same
special tokens and chat template, for every family's checkpoint and for configs naming model-specific classes."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from engine.tokenizer import _known_class_kwargs, load_tokenizer

TEXT = "<|im_start|>user\nHello, world! The cache is split into blocks.<|im_end|>\n  tabs\tand unicode: é ü 中"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]


def _variant(source: str, root, name: str, tokenizer_class: str | None, model_type: str | None = "llama",
             extra: dict | None = None) -> str:
    """A copy of `source`'s tokenizer whose tokenizer_config.json names `tokenizer_class` (None: names none) and
    whose config.json has `model_type` (None: no config.json)."""
    path = root / name
    path.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(os.path.join(source, file), path / file)
    with open(path / "tokenizer_config.json") as f:
        config = json.load(f)
    config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({**config, **(extra or {})}, f)
    if model_type is None:
        os.remove(path / "config.json")
    else:
        with open(path / "config.json") as f:
            model_config = json.load(f)
        with open(path / "config.json", "w") as f:
            json.dump({**model_config, "model_type": model_type}, f)
    return str(path)


def _assert_same(path: str) -> None:
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(theirs), path
    assert ours(TEXT)["input_ids"] == theirs(TEXT)["input_ids"] and len(ours(TEXT)["input_ids"]) > 5
    assert ours.decode(ours(TEXT)["input_ids"]) == theirs.decode(theirs(TEXT)["input_ids"])
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                                          theirs.pad_token_id)
    assert ours.all_special_tokens == theirs.all_special_tokens and len(ours) == len(theirs)
    if theirs.chat_template is not None:
        rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert "What is the capital?" in rendered


def test_every_family_s_tokenizer_loads_as_autotokenizer_loads_it(tiny_checkpoints):
    for path in tiny_checkpoints.values():
        assert "config" in _known_class_kwargs(path), path  # the shortcut is taken
        _assert_same(path)


@pytest.mark.parametrize("tokenizer_class,model_type", [
    ("PreTrainedTokenizerFast", "llama"), ("LlamaTokenizerFast", "llama"), ("LlamaTokenizer", "mistral"),
    ("Qwen2Tokenizer", "qwen2"), ("GPT2TokenizerFast", "gpt2"), ("TokenizersBackend", None)])
def test_a_named_class_is_chosen_as_autotokenizer_chooses_it(tiny_model_dir, tmp_path, tokenizer_class, model_type):
    path = _variant(tiny_model_dir, tmp_path, "variant", tokenizer_class, model_type)
    assert "config" in _known_class_kwargs(path)
    _assert_same(path)


def test_no_shortcut_where_the_class_is_not_named_or_remote_code_is_asked_for(tiny_model_dir, tmp_path):
    unnamed = _variant(tiny_model_dir, tmp_path, "unnamed", None)
    assert _known_class_kwargs(unnamed) == {}
    _assert_same(unnamed)  # AutoTokenizer's own path, from the model's config
    remote = _variant(tiny_model_dir, tmp_path, "remote", "PreTrainedTokenizerFast",
                      extra={"auto_map": {"AutoTokenizer": ["tok.Tok", None]}})
    assert _known_class_kwargs(remote) == {}
    assert _known_class_kwargs(str(tmp_path / "missing")) == {}


def test_loading_a_tokenizer_does_not_import_the_model_code(tiny_model_dir):
    """What the shortcut is for, shown by what gets imported (not by timing): in a fresh interpreter, the load leaves
    the modules behind the model's config class (torch.distributed.tensor, sympy) unimported, while AutoTokenizer's
    own path imports them."""
    probe = ("import sys, torch; from engine.tokenizer import load_tokenizer; from transformers import AutoTokenizer; "
             "{load}({path!r}); print(sorted(m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    imported = {}
    for load in ("load_tokenizer", "AutoTokenizer.from_pretrained"):
        result = subprocess.run([sys.executable, "-c", probe.format(load=load, path=tiny_model_dir)], env=env,
                                capture_output=True, text=True, timeout=300, check=True)
        imported[load] = result.stdout.strip().splitlines()[-1]
    assert imported["load_tokenizer"] == "[]", imported
    if imported["AutoTokenizer.from_pretrained"] == "[]":
        pytest.skip("this transformers' AutoTokenizer imports no model code either: nothing for the shortcut to save")
