"""Engine configuration: what users ask for (`EngineArgs`) and what the engine runs with (`EngineConfig`).

    EngineArgs (frozen, the one place for defaults; pure values: crosses processes, YAML, CLI flags)
        └── create_engine_config() on the node that has the model: reads config.json ──► EngineConfig
            = ModelConfig + CacheConfig + SchedulerConfig + ParallelConfig (+ stream_interval_s)

Each part of the system receives only the piece it needs: the scheduler a `SchedulerConfig`, the block manager a
`CacheConfig`, the workers a `ModelConfig` and a `ParallelConfig`. The CLI flags (engine/arg_utils.py), `LLM(...)`
and the Serve app's per-model args (cluster/app.py) are all made from `EngineArgs`' fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace

from engine.errors import ParamError
from engine.quantization import KV_CACHE_DTYPES, QuantConfig, resolve_quantization

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_LOAD_FORMATS = ("auto", "safetensors", "random")


@dataclass(frozen=True)
class ModelConfig:
    """What to run: a Hugging Face checkpoint directory or a GGUF file, and how to load it."""

    model: str  # a Hugging Face checkpoint directory or a .gguf file (checkpoints.source resolves user names)
    dtype: str = "auto"  # resolved by `resolve_dtype` once the device is known
    max_model_len: int = 0  # 0: take the checkpoint's max_position_embeddings
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None  # defaults to `model` (for a GGUF file: a directory built from its metadata)
    chat_template: str | None = None  # replaces the tokenizer's chat template (the template's text)
    quantization: str | None = None  # "fp8": FP8 linear layers quantized at load (an FP8 checkpoint needs none);
    # "awq" / "gptq": only names an int checkpoint's own method, which its quantization_config gives anyway (random
    # weights without one: a default int4 layout, engine/quantization.py RANDOM_INT_CONFIGS);
    # "gguf": a .gguf model's linears served from their blocks (engine/quantization.py; EngineArgs picks it for a
    # .gguf on a GPU); "none": a .gguf dequantized at load
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # config.json as loaded
    generation_config: dict = field(default_factory=dict, compare=False, repr=False)  # generation_config.json

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ParamError("dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ParamError("load_format", f"must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_model_len < 0:
            raise ParamError("max_model_len", f"must be >= 0, got {self.max_model_len}")
        if self.is_gguf and self.load_format == "safetensors":
            raise ParamError("load_format", f"'safetensors' does not read the GGUF file {self.model!r}")
        self.quant_config  # noqa: B018 - validates quantization against the checkpoint's quantization_config

    @classmethod
    def from_path(cls, model: str, **kwargs) -> "ModelConfig":
        """Reads `config.json` and `generation_config.json` (or a GGUF file's metadata) and fills `max_model_len`
        from it when not given."""
        hf_config: dict | None
        if model.endswith(".gguf"):
            from checkpoints.gguf import gguf_tokenizer_dir, read_gguf_model  # lazy: it imports torch and numpy

            info = read_gguf_model(model)
            hf_config = {**info.hf_config, "gguf_linear_types": list(info.linear_types)}  # for quantization="gguf"
            generation_config = info.generation_config
            if kwargs.get("tokenizer") is None:
                kwargs["tokenizer"] = gguf_tokenizer_dir(model, info.header_digest)
        else:
            hf_config = _read_json(os.path.join(model, "config.json"))
            if hf_config is None:
                raise ParamError("model", f"{model!r} is not a checkpoint directory (no config.json)")
            hf_config = with_quantize_config(hf_config, _read_json(os.path.join(model, "quantize_config.json")))
            generation_config = _read_json(os.path.join(model, "generation_config.json")) or {}
        config = cls(model=model, hf_config=hf_config, generation_config=generation_config, **kwargs)
        limit = model_context_length(hf_config)
        if config.max_model_len == 0:
            return replace(config, max_model_len=limit)
        if config.max_model_len > limit:  # as vLLM: positions past what the model was built for are refused
            raise ParamError("max_model_len", f"{config.max_model_len} is longer than this model's context of "
                                              f"{limit} tokens")
        return config

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    @property
    def quant_config(self) -> QuantConfig | None:
        """The scheme of the linear layers (FP8, AWQ, GPTQ; None: unquantized); ValueError if the checkpoint's is
        unsupported."""
        return resolve_quantization(self.quantization, self.hf_config, self.load_format == "random")

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


def model_context_length(hf_config: dict) -> int:
    """The longest sequence a checkpoint supports: max_position_embeddings, stretched by a RoPE scaling that
    extends the context past it (linear, dynamic NTK, YaRN: factor x the original length)."""
    limit = int(hf_config.get("max_position_embeddings", 2048))
    scaling = hf_config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) in ("linear", "dynamic", "yarn"):
        base = int(scaling.get("original_max_position_embeddings") or limit)
        limit = max(limit, int(base * float(scaling.get("factor", 1.0))))
    return limit


def with_quantize_config(hf_config: dict, quantize_config: dict | None) -> dict:
    """GPTQ tools write quantize_config.json beside config.json (AutoGPTQ's older versions only it): its fields
    fill what config.json's quantization_config of the same method lacks, checkpoint_format above all (v2's zero
    points read as v1's would be off by one)."""
    if not quantize_config:
        return hf_config
    extra = {"quant_method": "gptq", **quantize_config}  # AutoGPTQ's file names no method: it is GPTQ's
    qc = hf_config.get("quantization_config")
    if qc is None:
        return {**hf_config, "quantization_config": extra}
    if qc.get("quant_method") != extra["quant_method"]:
        return hf_config
    return {**hf_config, "quantization_config": {**extra, **qc}}


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


KV_OFFLOAD_POLICIES = ("write-through", "write-back")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool. `num_kv_blocks=None` sizes the pool from free memory."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30  # the memory cap for the pool on CPU
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8_e4m3fn with per-head scales
    # The host-memory KV tier, per rank (vLLM's --swap-space): GiB of host memory in the device pool's block layout
    # and dtype; 0: none. num_host_kv_blocks, when set, is its size in blocks instead (tests).
    swap_space_gib: float = 0.0
    num_host_kv_blocks: int | None = None
    # Copy a prefix found on the host back, or compute it again (engine/onload_cost.py): one rank's host -> device
    # rate, the fixed cost of a step's onloads and the model's prefill rate, as `pagoda bench kv-tier-cost` measures
    # them (the defaults: estimates for an 8B model on an H200); min_onload_blocks, when set, is the threshold itself.
    onload_gb_per_s: float = 25.0
    onload_latency_s: float = 2e-4
    prefill_tokens_per_s: float = 20_000.0
    min_onload_blocks: int | None = None
    # When a device block is written to the host tier (KV_OFFLOAD_POLICIES): "write-through", every block as it is
    # committed (the host holds a copy of everything the device caches: another replica's fetch finds it there);
    # "write-back", a cached block when the device pool evicts it (no copy at all while the pool has room).
    kv_offload_policy: str = "write-through"

    def __post_init__(self):
        if self.kv_offload_policy not in KV_OFFLOAD_POLICIES:
            raise ParamError("kv_offload_policy", f"must be one of {KV_OFFLOAD_POLICIES}, got "
                                                  f"{self.kv_offload_policy!r}")
        if self.swap_space_gib < 0:
            raise ParamError("swap_space", f"must be >= 0 GiB, got {self.swap_space_gib}")
        for name in ("onload_gb_per_s", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ParamError(name, f"must be > 0, got {getattr(self, name)}")
        if not self.onload_latency_s >= 0:
            raise ParamError("onload_latency_s", f"must be >= 0, got {self.onload_latency_s}")
        if self.min_onload_blocks is not None and self.min_onload_blocks < 1:
            raise ParamError("min_onload_blocks", f"must be >= 1, got {self.min_onload_blocks}")
        if self.num_host_kv_blocks is not None and self.num_host_kv_blocks < 0:
            raise ParamError("num_host_kv_blocks", f"must be >= 0, got {self.num_host_kv_blocks}")
        if (self.swap_space_gib or self.num_host_kv_blocks) and not self.enable_prefix_caching:
            raise ParamError("swap_space", "the host KV tier needs prefix caching (its blocks are found by the prefix "
                                           "cache's hashes): leave prefix caching on, or set no swap space")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ParamError("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ParamError("block_size", f"must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ParamError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ParamError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step."""

    # 512: Llama-3-8B FP8 at 4,096 x 128/128 on an H200 ran 21.5k output tok/s at 256, 23.7k at 512, 23.5k at 1,024
    # (there the GEMMs are compute-bound and the host's work per step catches up); 70B FP8: 3,334 -> 3,475
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    async_scheduling: bool = True  # schedule step N+1 while step N runs (when the executor can)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ParamError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ParamError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ParallelConfig:
    """Where the model runs: device kind and tensor-parallel degree."""

    tensor_parallel_size: int = 1
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    enforce_eager: bool = False
    use_ray: bool = False  # run even a single rank in a Ray actor (tp > 1 always uses Ray)

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ParamError("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ParamError("device", f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")


SPEC_METHODS = ("ngram", "draft_model")  # "eagle" is vLLM's too: not built, refused by name
_SPEC_NOT_BUILT = ("eagle", "eagle3", "medusa", "mtp")
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
              "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode.py), vLLM's speculative_config: {"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_min": m, "prompt_lookup_max": M, "disable_by_batch_size": B} or
    {"method": "draft_model", "model": a smaller model with the target's vocabulary, "num_speculative_tokens": k,
    "disable_by_batch_size": B}. Unknown keys and methods are refused (ParamError, a ValueError naming the key).
    disable_by_batch_size: no drafts while more than B requests decode (None: the engine decides each step from the
    measured acceptance and step costs, engine/spec_decode.py SpecDecoder.should_speculate). `draft_model_config` is
    the draft's checkpoint as read by create_engine_config (not a key users give)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: any name checkpoints.source.resolve_model takes
    draft_model_config: ModelConfig | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method in _SPEC_NOT_BUILT:
            raise ParamError("speculative_config.method", f"{self.method!r} is not built in Pagoda (only "
                                                          f"{SPEC_METHODS}): no EAGLE proposer yet")
        if self.method not in SPEC_METHODS:
            raise ParamError("speculative_config.method", f"must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ParamError("speculative_config.model", f"draft_model needs the draft's model (a checkpoint "
                                                         f"directory or name), got {self.model!r}")
        if self.method != "draft_model" and self.model is not None:
            raise ParamError("speculative_config.model", f"is for method 'draft_model' only, not {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParamError(f"speculative_config.{name}", f"must be a positive integer, got {value!r}")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or isinstance(self.disable_by_batch_size, bool)
                or self.disable_by_batch_size < 1):
            raise ParamError("speculative_config.disable_by_batch_size",
                             f"must be a positive integer, got {self.disable_by_batch_size!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ParamError("speculative_config.prompt_lookup_min",
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}")

    @classmethod
    def from_dict(cls, values: dict | None) -> SpeculativeConfig | None:
        """None (or an empty dict): no speculation. A missing prompt_lookup_min/max takes the other's value when
        only one is given (as vLLM), else 1 and 4 (vLLM's ngram defaults are 5..5; Pagoda keeps shorter matches)."""
        if not values:
            return None
        if not isinstance(values, dict):
            raise ParamError("speculative_config", f"must be a JSON object, got {type(values).__name__}")
        unknown = [key for key in values if key not in _SPEC_KEYS]
        if unknown:
            raise ParamError(f"speculative_config.{unknown[0]}", f"is not a key Pagoda knows (keys: {_SPEC_KEYS})")
        if "num_speculative_tokens" not in values:
            raise ParamError("speculative_config.num_speculative_tokens", "is required")
        values = dict(values)
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(values["prompt_lookup_min"], cls.prompt_lookup_max)
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"], cls.prompt_lookup_min)
        return cls(**values)


COMPILATION_LEVELS = (0, 3)  # vLLM's NO_COMPILATION and PIECEWISE; its 1 and 2 (dynamo alone) are not offered
_COMPILATION_KEYS = ("level", "mode")  # "mode": vLLM's newer name for the level
# DeepSeek-V2's adapters on kv_b_proj fold into the absorbed queries and outputs by calls that have no op yet
_NOT_COMPILED_WITH_LORA = ("DeepseekV2ForCausalLM",)


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's compilation_config: level 0 runs the model eagerly (Pagoda's hand-fused kernels, decode under CUDA
    graphs); level 3 compiles its decoder layers with torch.compile (workers/compile.py): inductor generates the
    code between Pagoda's GEMMs, KV writes and attention (kernels/ops.py, opaque custom ops), one graph for any
    number of tokens, and the decode CUDA graphs capture the compiled code. Given as an int, or {"level": n}
    ({"mode": n}). What has no op yet is refused (`check`)."""

    level: int = 0

    def __post_init__(self):
        if self.level not in COMPILATION_LEVELS:
            raise ParamError("compilation_config.level", f"must be one of {COMPILATION_LEVELS} (0: eager, 3: "
                                                         f"torch.compile around Pagoda's kernels), got {self.level!r}")

    @classmethod
    def from_value(cls, value: int | str | dict | None) -> CompilationConfig:
        if value is None:
            return cls()
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value)
        if not isinstance(value, dict):
            raise ParamError("compilation_config", f"must be a level (0 or 3) or a JSON object, got {value!r}")
        unknown = [key for key in value if key not in _COMPILATION_KEYS]
        if unknown:
            raise ParamError(f"compilation_config.{unknown[0]}", f"is not a key Pagoda knows (keys: "
                                                                 f"{_COMPILATION_KEYS})")
        if "level" in value and "mode" in value and value["level"] != value["mode"]:
            raise ParamError("compilation_config.mode", "is the level's other name: give one of them")
        level = value.get("level", value.get("mode", 0))
        if not isinstance(level, int) or isinstance(level, bool):
            raise ParamError("compilation_config.level", f"must be an integer, got {level!r}")
        return cls(level)

    def check(self, model: ModelConfig, parallel: ParallelConfig, lora: LoRAConfig | None) -> None:
        """Refuses what level 3 does not compile (yet), naming it."""
        if self.level == 0:
            return
        if parallel.enforce_eager:
            raise ParamError("compilation_config.level", "level 3 compiles the model; enforce_eager keeps it eager: "
                                                         "give one of them")
        architectures = model.hf_config.get("architectures") or []
        if lora is not None and any(arch in _NOT_COMPILED_WITH_LORA for arch in architectures):
            raise ParamError("compilation_config.level", f"level 3 does not compile LoRA adapters on "
                                                         f"{architectures} yet: serve them with level 0")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (engine/lora.py): `max_loras` adapters in GPU slots at once (the distinct adapters a step
    can run), ranks up to `max_lora_rank`, `max_cpu_loras` adapters' tensors cached in each worker's host memory."""

    max_loras: int = 1
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # default: max_loras

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            _check_positive_int(name, getattr(self, name))
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _check_positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ParamError("max_cpu_loras", f"must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    # A streaming request's deltas come at most this often (its first token and its end at once): with many
    # streams, fewer and larger messages from the engine to the socket. 0: a delta at every step that moved it.
    stream_interval_s: float = 0.0
    lora: LoRAConfig | None = None  # None: no adapters (enable_lora off)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    compilation: CompilationConfig = CompilationConfig()  # level 0: eager


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting a user can give, with its default: `LLM(**kwargs)`, the CLI flags and the Serve app's
    per-model args are made from these fields. Pure values, so it crosses process boundaries and YAML as is;
    `create_engine_config()` runs where the model is (it reads the checkpoint's config.json)."""

    model: str | None = None  # a checkpoint directory; None: the built-in model
    tokenizer: str | None = None  # default: the model's
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    max_model_len: int | None = None  # default: the model's context length
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: sized from free memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = 8192
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    use_ray: bool = False
    stream_interval_s: float = 0.0
    chat_template: str | None = None  # a file, or the template's text: replaces the tokenizer's
    quantization: str | None = None  # "fp8": FP8 linear layers, quantized at load (docs: README, FP8); None: the
    # checkpoint's own ("gguf" for a .gguf on a GPU: create_engine_config); "none": a .gguf dequantized at load
    kv_cache_dtype: str = "auto"  # "fp8": an e4m3 KV pool
    swap_space: float = 0.0  # GiB of host memory per rank for the host KV tier (vLLM's name); 0: none
    num_host_kv_blocks: int | None = None  # the host tier's size in blocks instead (tests)
    # copy a host-tier prefix back or compute it again (CacheConfig; engine/onload_cost.py)
    onload_gb_per_s: float = 25.0
    onload_latency_s: float = 2e-4
    prefill_tokens_per_s: float = 20_000.0
    min_onload_blocks: int | None = None  # the threshold itself instead of the cost model's
    kv_offload_policy: str = "write-through"  # when blocks go to the host tier (CacheConfig)
    enable_lora: bool = False  # LoRA adapters per request (engine/lora.py)
    max_loras: int = 1  # adapters resident on the GPU at once
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # adapters cached in host memory per worker; default: max_loras
    # vLLM's speculative_config dict, e.g. {"method": "ngram", "num_speculative_tokens": 4} (SpeculativeConfig)
    speculative_config: dict | None = None
    # vLLM's compilation_config: 0 (eager, the default) or 3 (torch.compile around Pagoda's kernels), or a dict
    # {"level": n} (CompilationConfig)
    compilation_config: int | dict | None = None

    def __post_init__(self):
        if self.dtype in _DTYPE_ALIASES:  # vLLM's spellings
            object.__setattr__(self, "dtype", _DTYPE_ALIASES[self.dtype])
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not 0.0 <= self.stream_interval_s <= 60.0:
            raise ParamError("stream_interval_s", f"must be in [0, 60], got {self.stream_interval_s}")
        # The parts validate the rest; build them now so a bad value fails here, where the user gave it.
        self._parts()
        self.lora_config()
        SpeculativeConfig.from_dict(self.speculative_config)
        CompilationConfig.from_value(self.compilation_config)

    def lora_config(self) -> LoRAConfig | None:
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def _parts(self) -> tuple[CacheConfig, SchedulerConfig, ParallelConfig]:
        if self.dtype not in _DTYPES:
            raise ParamError("dtype", f"must be one of {_DTYPES + tuple(_DTYPE_ALIASES)}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ParamError("load_format", f"must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        return (CacheConfig(self.block_size, self.num_kv_blocks, self.gpu_memory_utilization,
                            self.cpu_kv_cache_bytes, self.enable_prefix_caching, self.kv_cache_dtype, self.swap_space,
                            self.num_host_kv_blocks, self.onload_gb_per_s, self.onload_latency_s,
                            self.prefill_tokens_per_s, self.min_onload_blocks, self.kv_offload_policy),
                SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len or 2048),
                ParallelConfig(self.tensor_parallel_size, self.device, self.enforce_eager, self.use_ray))

    def create_engine_config(self) -> EngineConfig:
        """`model` is any name checkpoints.source.resolve_model takes (None: the built-in SmolLM2)."""
        from engine.sampling_params import default_sampling_overrides
        from engine.tokenizer import read_chat_template

        path, quantization = self._checkpoint_and_quantization()
        model_config = ModelConfig.from_path(path, dtype=self.dtype, max_model_len=self.max_model_len or 0,
                                             load_format=self.load_format, seed=self.seed, tokenizer=self.tokenizer,
                                             chat_template=read_chat_template(self.chat_template),
                                             quantization=quantization)
        default_sampling_overrides(model_config)  # a bad generation_config.json fails here, not at the first request
        cache, scheduler, parallel = self._parts()
        lora = self.lora_config()
        if lora is not None:
            from engine.lora import lora_module_shapes

            lora_module_shapes(model_config.hf_config)  # a family that takes no adapter fails here
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if speculative is not None and speculative.method == "draft_model":
            speculative = replace(speculative, draft_model_config=self._draft_model_config(speculative, model_config))
        compilation = CompilationConfig.from_value(self.compilation_config)
        compilation.check(model_config, parallel, lora)
        return EngineConfig(model_config, cache, replace(scheduler, max_model_len=model_config.max_model_len),
                            parallel, self.stream_interval_s, lora, speculative, compilation)

    def _draft_model_config(self, speculative: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
        """The draft model's checkpoint, read as the target's (same dtype, seed and context); its vocabulary must be
        the target's: the drafts are the target's token ids."""
        from checkpoints.source import resolve_model

        try:
            draft = ModelConfig.from_path(resolve_model(speculative.model), dtype=self.dtype,
                                          max_model_len=target.max_model_len, load_format=self.load_format,
                                          seed=self.seed)
        except (ParamError, OSError, ValueError) as e:
            raise ParamError("speculative_config.model", f"cannot be read as a draft model: {e}") from e
        draft_vocab, target_vocab = draft.hf_config.get("vocab_size"), target.hf_config.get("vocab_size")
        if draft_vocab != target_vocab:
            raise ParamError("speculative_config.model", f"{speculative.model!r} has a vocabulary of {draft_vocab} "
                                                         f"tokens, the target {target_vocab}: a draft model must share "
                                                         f"the target's tokenizer")
        return draft

    def _checkpoint_and_quantization(self) -> tuple[str, str | None]:
        """The checkpoint to load and its quantization. Given none: with GGUF_BLOCKS_BY_DEFAULT_ON_GPU, a .gguf
        model on a GPU serves its decoder linears from their own blocks ("gguf": a quarter to a half of a bf16
        weight's bytes read per token) and the built-in SmolLM2 loads from its Q4_1 file rather than its float32
        conversion; otherwise, and always on CPU, a GGUF is dequantized at load (the int layers' torch reference
        would dequantize every weight at every step, slower than float weights). quantization="none" dequantizes
        too. The device is this process's view ("auto": a GPU visible here; the Serve app resolves it for the
        replica's placement before)."""
        # lazy, not upward: checkpoints is a leaf, but its imports (tempfile, shutil, ...) would double the time of
        # `import engine.config`, which every process pays, the ingress's too
        from checkpoints.source import resolve_model

        if self.quantization is not None:
            return resolve_model(self.model), self.quantization
        on_gpu = GGUF_BLOCKS_BY_DEFAULT_ON_GPU and resolve_device(self.device) == "cuda"
        if self.model is None and on_gpu:
            from checkpoints.builtin import default_gguf_path

            return default_gguf_path(), "gguf"
        path = resolve_model(self.model)
        return path, "gguf" if path.endswith(".gguf") and on_gpu else None


# Whether a .gguf model on a GPU is served from its own blocks when no quantization is given. Off until the int
# kernels beat dequantized bf16 there at every batch: 8B AWQ through the stream kernel decodes at 3.67 ms/token at
# batch 1 against bf16's 4.30, but 19.91 at batch 64 (benchmarks/results/h200-latency-llama3-8b-awq-splits.json), and
# GGUF's groups of 16 and 32 do not take that kernel. `--quantization gguf` asks.
GGUF_BLOCKS_BY_DEFAULT_ON_GPU = False

_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParamError(name, f"must be a positive integer, got {value!r}")


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
