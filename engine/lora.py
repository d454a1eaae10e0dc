"""LoRA adapters on the driver: what a request names (`LoRARequest`, vLLM's offline API), an adapter's files read
and checked once (`read_adapter`), and which adapter sits in which of the workers' GPU slots (`LoRASlots`).

An adapter is a PEFT directory:

    adapter_config.json        r, lora_alpha, use_rslora, target_modules (a list or a regex), ...
    adapter_model.safetensors  base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
                               A: [r, in_features]   B: [out_features, r]

Its delta on a target linear is `scaling * B @ A @ x`, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
Only the files' headers are read here (stdlib only); the workers read the tensors, in the background, into the
host-memory cache `LoRAHostCache` keeps (`max_cpu_loras` adapters): a request takes a GPU slot only once its
adapter is there, so no step waits for a file.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.errors import ParamError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "Phi3ForCausalLM")
_FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)  # checkpoints (and so PEFT adapters) with qkv_proj and gate_up_proj
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM",)  # an MoE family with latent attention
_TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`): `id` (>= 1) names
    it across the engine (its GPU slot, its prefix-cache blocks); one id is one adapter."""

    name: str
    id: int
    path: str

    def __post_init__(self):
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 1:
            raise ParamError("lora_request", f"id must be a positive integer, got {self.id!r}")
        if not self.name:
            raise ParamError("lora_request", "name must not be empty")

    # vLLM's attribute names
    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_int_id(self) -> int:
        return self.id

    @property
    def lora_path(self) -> str:
        return self.path


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter whose files were read and checked against the base model: what the workers need to load it."""

    request: LoRARequest
    rank: int
    scaling: float  # folded into B at load
    modules: frozenset[tuple[int, str]]  # (layer, module) pairs it changes


def lora_module_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """The base model's LoRA-capable linears: module name -> (in_features, out_features), whole (not sharded).
    Dense Llama / Mistral / Qwen: every projection; Phi-3: its checkpoint's fused qkv_proj and gate_up_proj, o_proj
    and down_proj; MoE families: attention only (their experts take no adapter), DeepSeek-V2's latent attention
    too (`_mla_module_shapes`). ParamError for a family that takes none."""
    architectures = hf_config.get("architectures") or []
    supported = _DENSE_ARCHITECTURES + _MOE_ARCHITECTURES + _MLA_ARCHITECTURES
    if not any(a in supported for a in architectures):
        raise ParamError("enable_lora", f"LoRA adapters are not supported on {architectures} (supported: "
                                        f"{list(supported)})")
    hidden, num_heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    if any(a in _MLA_ARCHITECTURES for a in architectures):
        return _mla_module_shapes(hf_config, hidden, num_heads)
    head_dim = int(hf_config.get("head_dim") or hidden // num_heads)
    kv = int(hf_config.get("num_key_value_heads") or num_heads) * head_dim
    shapes = {"q_proj": (hidden, num_heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (num_heads * head_dim, hidden)}
    if any(a in _DENSE_ARCHITECTURES for a in architectures):
        inter = int(hf_config["intermediate_size"])
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    if any(a in _FUSED_ARCHITECTURES for a in architectures):
        shapes = {"qkv_proj": (hidden, num_heads * head_dim + 2 * kv), "o_proj": shapes["o_proj"],
                  "gate_up_proj": (hidden, 2 * shapes["gate_proj"][1]), "down_proj": shapes["down_proj"]}
    return shapes


def _mla_module_shapes(hf_config: dict, hidden: int, num_heads: int) -> dict[str, tuple[int, int]]:
    """DeepSeek-V2's attention: q_proj (or q_a_proj and q_b_proj), kv_a_proj_with_mqa, kv_b_proj (whose delta the
    workers fold into the absorbed queries and outputs as they fold its weight: workers/lora.py
    `LatentLoRAWeights`) and o_proj. Its MLPs take none, as the other MoE families' (peft itself turns gate/up/down
    targets on this family into its experts' parameters)."""
    nope, rope = int(hf_config["qk_nope_head_dim"]), int(hf_config["qk_rope_head_dim"])
    latent, v, q_rank = int(hf_config["kv_lora_rank"]), int(hf_config["v_head_dim"]), hf_config.get("q_lora_rank")
    q_rows = num_heads * (nope + rope)
    shapes = ({"q_proj": (hidden, q_rows)} if not q_rank else
              {"q_a_proj": (hidden, int(q_rank)), "q_b_proj": (int(q_rank), q_rows)})
    return shapes | {"kv_a_proj_with_mqa": (hidden, latent + rope), "kv_b_proj": (latent, num_heads * (nope + v)),
                     "o_proj": (num_heads * v, hidden)}


def parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """(layer, module, "A" | "B") of a PEFT tensor name; None for a name that is not a LoRA A or B of a layer."""
    match = _TENSOR_NAME.match(name)
    return None if match is None else (int(match.group(1)), match.group(2), match.group(3))


def read_adapter(request: LoRARequest, hf_config: dict, max_lora_rank: int) -> LoRAAdapter:
    """Reads the adapter's config and its tensors' header and checks them against the base model; ParamError
    naming the adapter and what is wrong (a missing file, an unsupported PEFT option, a rank over max_lora_rank, a
    tensor of the wrong shape or for a module the base has no slot for)."""
    config = _read_config(request)
    rank = _config_field(request, config, "r", int)
    alpha = float(config.get("lora_alpha", rank))
    use_rslora = bool(config.get("use_rslora", False))
    if rank < 1:
        raise _error(request, f"r must be >= 1, got {rank}")
    if rank > max_lora_rank:
        raise _error(request, f"r = {rank} is larger than max_lora_rank ({max_lora_rank})")
    if config.get("modules_to_save"):
        raise _error(request, f"modules_to_save ({config['modules_to_save']}) is not supported: only LoRA deltas")
    if config.get("bias", "none") != "none":
        raise _error(request, f"bias = {config['bias']!r} is not supported (only 'none')")
    if config.get("use_dora"):
        raise _error(request, "use_dora (DoRA) is not supported")
    if config.get("peft_type", "LORA") != "LORA":
        raise _error(request, f"peft_type {config['peft_type']!r} is not supported (only 'LORA')")
    for field_name in ("rank_pattern", "alpha_pattern"):
        if config.get(field_name):
            raise _error(request, f"{field_name} is not supported (one rank and alpha for every module)")
    modules = _check_tensors(request, _read_header(request), rank, hf_config)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return LoRAAdapter(request, rank, scaling, frozenset(modules))


def _check_tensors(request: LoRARequest, header: dict, rank: int, hf_config: dict) -> set[tuple[int, str]]:
    shapes = lora_module_shapes(hf_config)
    num_layers = int(hf_config["num_hidden_layers"])
    seen: dict[tuple[int, str], set[str]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise _error(request, f"tensor {name!r} is not a LoRA A or B weight of a decoder layer")
        layer, module, kind = parsed
        if module not in shapes or layer >= num_layers:
            raise _error(request, f"tensor {name!r}: the base model has no LoRA-capable {module} in layer {layer}")
        in_features, out_features = shapes[module]
        expected = [rank, in_features] if kind == "A" else [out_features, rank]
        if list(info["shape"]) != expected:
            raise _error(request, f"tensor {name!r} has shape {list(info['shape'])}, the base model needs {expected}")
        seen.setdefault((layer, module), set()).add(kind)
    for (layer, module), kinds in seen.items():
        if kinds != {"A", "B"}:
            raise _error(request, f"layer {layer} {module} has lora_{''.join(kinds)} without its pair")
    if not seen:
        raise _error(request, f"{WEIGHTS_FILE} holds no LoRA weights")
    return set(seen)


def _read_config(request: LoRARequest) -> dict:
    path = os.path.join(request.path, CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _error(request, f"has no {CONFIG_FILE} in {request.path!r}") from None
    except (OSError, ValueError) as e:
        raise _error(request, f"{CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise _error(request, f"{CONFIG_FILE} is not a JSON object")
    return config


def _read_header(request: LoRARequest) -> dict:
    """The safetensors header (tensor name -> dtype, shape, offsets): 8 bytes of length, then JSON."""
    path = os.path.join(request.path, WEIGHTS_FILE)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise _error(request, f"has no {WEIGHTS_FILE} in {request.path!r}") from None
    except (OSError, ValueError, struct.error) as e:
        raise _error(request, f"{WEIGHTS_FILE} is not a safetensors file: {e}") from None
    return header


def load_error(adapter: LoRAAdapter, error: str) -> ParamError:
    """Why the requests of an adapter whose weights failed to load (on a worker, after `read_adapter` passed) fail:
    the ParamError the checks above give, naming the adapter."""
    return _error(adapter.request, f"failed to load: {error}")


def _config_field(request: LoRARequest, config: dict, name: str, kind: type):
    value = config.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _error(request, f"{CONFIG_FILE}: {name} must be {kind.__name__}, got {value!r}")
    return value


def _error(request: LoRARequest, message: str) -> ParamError:
    return ParamError("lora_request", f"adapter {request.name!r} (id {request.id}): {message}")


class LoRASlots:
    """Which adapter is in which of the workers' `max_loras` GPU slots, and which running requests use each.

    A request is admitted only with its adapter in a slot: `can_acquire` says whether it is there or can be put
    there (a free slot, or the least recently used one that no running request uses; with a host cache, only an
    adapter the workers hold in host memory already), `acquire` takes it (queueing the load the next step makes:
    `take_loads`), `release` drops a request's use (finished or preempted; the adapter stays loaded until its slot
    is needed). `host` (None: the workers read an adapter's file when its slot is loaded) reads the adapters of
    waiting requests ahead (`prefetch`)."""

    def __init__(self, max_loras: int, max_cpu_loras: int | None = None):
        self.num_slots = max_loras
        self._adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._users = [0] * max_loras  # running requests of each slot
        self._recency: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU first
        self._loads: list[tuple[int, LoRAAdapter]] = []
        self.num_loads = 0
        self.host = LoRAHostCache(max_cpu_loras) if max_cpu_loras is not None else None

    @property
    def num_reading(self) -> int:
        """Adapters the workers are reading into host memory now."""
        return self.host.num_reading if self.host is not None else 0

    def slot_of(self, adapter_id: int) -> int | None:
        for slot, adapter in enumerate(self._adapters):
            if adapter is not None and adapter.request.id == adapter_id:
                return slot
        return None

    def can_acquire(self, adapter_id: int) -> bool:
        if self.slot_of(adapter_id) is not None:
            return True
        return (self.host is None or self.host.is_ready(adapter_id)) and self._victim() is not None

    def prefetch(self, adapters: Iterable[LoRAAdapter]) -> None:
        """Has the host cache read ahead the adapters of waiting requests (in queue order) that have no slot: the
        first `max_cpu_loras` distinct ones."""
        if self.host is None:
            return
        wanted: dict[int, LoRAAdapter] = {}
        for adapter in adapters:
            if len(wanted) >= self.host.capacity:
                break
            if adapter.request.id not in wanted and self.slot_of(adapter.request.id) is None:
                wanted[adapter.request.id] = adapter
        self.host.prefetch(list(wanted.values()))

    def acquire(self, adapter: LoRAAdapter) -> int:
        slot = self.slot_of(adapter.request.id)
        if slot is None:
            slot = self._victim()
            assert slot is not None, f"no slot for adapter {adapter.request.id}: call can_acquire first"
            self._adapters[slot] = adapter
            self._loads.append((slot, adapter))
            self.num_loads += 1
            if self.host is not None:
                self.host.touch(adapter.request.id)
        self._users[slot] += 1
        self._recency.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        assert self._users[slot] > 0, f"slot {slot} released more often than acquired"
        self._users[slot] -= 1

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        """The adapters the next step loads before its forward: (slot, adapter)."""
        loads, self._loads = self._loads, []
        return loads

    def _victim(self) -> int | None:
        """An empty slot, else the least recently used one that no running request uses."""
        if None in self._adapters:
            return self._adapters.index(None)
        return next((s for s in self._recency if self._users[s] == 0), None)

    def check_integrity(self, users: list[int]) -> None:
        assert self._users == users, f"slot users {self._users}, running requests per slot {users}"
        if self.host is not None:
            self.host.check_integrity()


class LoRAHostCache:
    """The adapters the workers hold in host memory (`max_cpu_loras`, LRU), as the driver decides it, so that every
    rank's cache is this one.

    `prefetch` (the scheduler, for the adapters its waiting requests name) queues an adapter's read; each worker
    reads the file and prepares its parts on a thread of its own (workers/lora.py), off the step loop. `finish`
    (the engine, once every rank reported the read: Executor.take_lora_reads) makes it ready, or drops it with the
    error. Only a ready adapter is put in a GPU slot. Room is made by evicting the least recently used ready adapter
    that no waiting request ahead names; evictions and reads reach the workers in step order
    (SchedulerOutput.lora_evictions, lora_reads: `take_commands`)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[int, bool] = OrderedDict()  # adapter id -> is ready (else being read); LRU first
        self._reading: dict[int, LoRAAdapter] = {}  # read id -> its adapter
        self._read_ids = itertools.count(1)
        self._reads: list[tuple[int, LoRAAdapter]] = []
        self._evictions: list[int] = []
        self.num_reads = 0

    @property
    def num_reading(self) -> int:
        return len(self._reading)

    def is_ready(self, adapter_id: int) -> bool:
        return self._entries.get(adapter_id, False)

    def prefetch(self, adapters: list[LoRAAdapter]) -> None:
        """Starts the reads of those adapters (most wanted first) that are not in host memory, as far as there is
        room; the others wait for a later call."""
        wanted = {a.request.id for a in adapters}
        for adapter in adapters:
            adapter_id = adapter.request.id
            if adapter_id in self._entries:
                continue
            if len(self._entries) >= self.capacity and not self._evict(wanted):
                return
            read_id = next(self._read_ids)
            self._entries[adapter_id] = False
            self._reading[read_id] = adapter
            self._reads.append((read_id, adapter))
            self.num_reads += 1

    def _evict(self, keep: set[int]) -> bool:
        victim = next((a for a, is_ready in self._entries.items() if is_ready and a not in keep), None)
        if victim is None:
            return False
        del self._entries[victim]
        self._evictions.append(victim)
        return True

    def touch(self, adapter_id: int) -> None:
        """The adapter was used (put in a GPU slot): the most recent."""
        if adapter_id in self._entries:
            self._entries.move_to_end(adapter_id)

    def finish(self, read_id: int, error: str | None) -> LoRAAdapter | None:
        """Every rank has finished the read (`error`: the first rank's failure, which drops the adapter from every
        rank's cache). Returns its adapter; None for a read this cache does not know."""
        adapter = self._reading.pop(read_id, None)
        if adapter is None:
            return None
        if error is None:
            self._entries[adapter.request.id] = True
        else:
            del self._entries[adapter.request.id]
            self._evictions.append(adapter.request.id)
        return adapter

    def take_commands(self) -> tuple[list[int], list[tuple[int, LoRAAdapter]]]:
        """(evictions, reads) for the next step to send."""
        commands = self._evictions, self._reads
        self._evictions, self._reads = [], []
        return commands

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.capacity, f"{len(self._entries)} adapters in a host cache of {self.capacity}"
        reading = sorted(a.request.id for a in self._reading.values())
        assert reading == sorted(a for a, is_ready in self._entries.items() if not is_ready), \
            f"adapters being read {reading}, cache {dict(self._entries)}"
