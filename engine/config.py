"""Engine configuration: small frozen dataclasses, composed into one `EngineConfig`.

Each part of the system receives only the piece it needs: the scheduler a `SchedulerConfig`, the block manager a
`CacheConfig`, the workers a `ModelConfig` and a `ParallelConfig`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_LOAD_FORMATS = ("auto", "safetensors", "random")


@dataclass(frozen=True)
class ModelConfig:
    """What to run: a Hugging Face checkpoint directory or a GGUF file, and how to load it."""

    model: str  # a Hugging Face checkpoint directory or a .gguf file (engine.model_source resolves user names)
    dtype: str = "auto"  # resolved by `resolve_dtype` once the device is known
    max_model_len: int = 0  # 0: take the checkpoint's max_position_embeddings
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None  # defaults to `model` (for a GGUF file: a directory built from its metadata)
    chat_template: str | None = None  # replaces the tokenizer's chat template (the template's text)
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # config.json as loaded
    generation_config: dict = field(default_factory=dict, compare=False, repr=False)  # generation_config.json

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.is_gguf and self.load_format == "safetensors":
            raise ValueError(f"load_format 'safetensors' does not read the GGUF file {self.model!r}")

    @classmethod
    def from_path(cls, model: str, **kwargs) -> "ModelConfig":
        """Reads `config.json` and `generation_config.json` (or a GGUF file's metadata) and fills `max_model_len`
        from it when not given."""
        if model.endswith(".gguf"):
            from workers.gguf import gguf_tokenizer_dir, read_gguf_model  # lazy: engine imports no workers at import

            info = read_gguf_model(model)
            hf_config, generation_config = info.hf_config, info.generation_config
            if kwargs.get("tokenizer") is None:
                kwargs["tokenizer"] = gguf_tokenizer_dir(model, info.header_digest)
        else:
            hf_config = _read_json(os.path.join(model, "config.json"))
            if hf_config is None:
                raise ValueError(f"model {model!r} is not a checkpoint directory (no config.json)")
            generation_config = _read_json(os.path.join(model, "generation_config.json")) or {}
        config = cls(model=model, hf_config=hf_config, generation_config=generation_config, **kwargs)
        limit = int(hf_config.get("max_position_embeddings", 2048))
        if config.max_model_len == 0:
            return replace(config, max_model_len=limit)
        return config

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for config in (self.hf_config, self.generation_config):  # generation_config.json often lists more
            eos = config.get("eos_token_id")
            for token_id in (eos if isinstance(eos, list) else [] if eos is None else [eos]):
                if int(token_id) not in ids:
                    ids.append(int(token_id))
        return tuple(ids)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool. `num_kv_blocks=None` sizes the pool from free memory."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30  # the memory cap for the pool on CPU
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    async_scheduling: bool = True  # schedule step N+1 while step N runs (when the executor can)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ParallelConfig:
    """Where the model runs: device kind and tensor-parallel degree."""

    tensor_parallel_size: int = 1
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    enforce_eager: bool = False
    use_ray: bool = False  # run even a single rank in a Ray actor (tp > 1 always uses Ray)

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig


def resolve_device(device: str) -> str:
    """'auto' becomes 'cuda' when a GPU is visible, else 'cpu'."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, hf_config: dict) -> str:
    """'auto': the checkpoint's torch_dtype on GPU (bf16 for fp32 checkpoints), float32 on CPU."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return "bfloat16" if declared == "float32" else declared
