"""The LoRA adapters the HTTP edge serves by name: those given at start (`--lora-modules`, the app arg
`lora_modules`) and those loaded at run time (`POST /v1/load_lora_adapter`), for every ingress replica alike.

    client model="sql" ──► Ingress: LoRARegistry.get("sql") ──► LoRAModule(base "llama", LoRARequest("sql", 3, path))
                                   └─► the base's LLMServer deployment, GenerateRequest.lora_request = that request

A request carries its `LoRARequest` to whichever replica runs it; the replica's engine reads and checks the
adapter's files when its id first comes (engine/lora.py). So replicas hold no list of adapters, and one started
later by the autoscaler serves every adapter at once. An adapter's id is a hash of its name and path
(`adapter_id`): the same adapter has the same id wherever and whenever it is named, and an engine that outlives a
redeployment never sees one id stand for two adapters. Only the ingress replicas must agree on names: the adapters
loaded at run time live in Ray's GCS key-value store (the one Serve keeps its own state in), under a key that
build_app draws anew for each deployment of the app:

    pagoda_lora / <store_key>/name/<name> -> {"id", "path", "base_model_name"}

A name is claimed atomically (a put that does not overwrite), so two ingress replicas loading at once cannot give
it twice. Unloading deletes the name: requests already running keep their adapter (they carry it) and finish;
later requests for the name get a 404; the adapter's GPU slot and host-cache copy go to other adapters by LRU. A
redeployed app starts again from its lora_modules (its store key is new); the old keys stay in the GCS, a few
bytes an adapter.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field

from cluster import errors
from engine.lora import LoRARequest

KV_NAMESPACE = "pagoda_lora"


def adapter_id(name: str, path: str) -> int:
    """The engine's id of an adapter: 63 bits of a hash of its name and path (>= 1)."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served by name: the served model (`base_model_name`) that runs it, and the request it runs with."""

    base_model_name: str
    request: LoRARequest
    is_static: bool = False  # given at start: not unloaded at run time

    @property
    def name(self) -> str:
        return self.request.name

    def card(self) -> dict:
        """Its /v1/models fields beside id and object, as vLLM gives them: root = its path, parent = the base."""
        return {"root": self.request.path, "parent": self.base_model_name}


@dataclass
class LoRAConfig:
    """The ingress's part of the app args (cluster/app.py _lora_config)."""

    modules: list[dict] = field(default_factory=list)  # {"name", "id", "path", "base_model_name"}
    models: list[str] = field(default_factory=list)  # served models that take adapters (enable_lora)
    allow_runtime_updating: bool = False
    store_key: str = ""


class LoRARegistry:
    """name -> LoRAModule for one ingress replica: the static ones in memory, the runtime ones in the GCS."""

    def __init__(self, config: LoRAConfig):
        self.config = config
        self.static = {m["name"]: LoRAModule(m["base_model_name"], LoRARequest(m["name"], m["id"], m["path"]), True)
                       for m in config.modules}

    async def get(self, name: str) -> LoRAModule | None:
        module = self.static.get(name)
        if module is not None or not self.config.allow_runtime_updating:
            return module
        return await asyncio.to_thread(self._read, name)

    async def list(self) -> list[LoRAModule]:
        runtime = await asyncio.to_thread(self._read_all) if self.config.allow_runtime_updating else []
        return list(self.static.values()) + runtime

    async def add(self, name: str, path: str, base_model_name: str, check) -> LoRAModule:
        """Awaits `check(module)` (which raises for a bad adapter), then publishes the name; InvalidRequestError if
        the name is taken (also by another ingress replica meanwhile)."""
        if name in self.static or await self.get(name) is not None:
            raise _duplicate(name)
        module = LoRAModule(base_model_name, LoRARequest(name, adapter_id(name, path), path))
        await check(module)
        value = json.dumps({"id": module.request.id, "path": path, "base_model_name": base_model_name})
        if await asyncio.to_thread(_kv_put, self._name_key(name), value):
            raise _duplicate(name)
        return module

    async def remove(self, name: str) -> LoRAModule:
        """Stops serving a runtime adapter; NotFoundError for an unknown name, InvalidRequestError for a static one."""
        if name in self.static:
            raise errors.InvalidRequestError(f"LoRA adapter {name!r} was given at start (lora_modules) and cannot be "
                                             "unloaded at run time", "lora_name")
        module = await self.get(name)
        if module is None or not await asyncio.to_thread(_kv_del, self._name_key(name)):
            raise errors.NotFoundError(f"The LoRA adapter {name!r} cannot be found.", "lora_name")
        return module

    # ---- the GCS store (blocking calls: run in a thread) ----------------------------------------------------------
    def _name_key(self, name: str) -> str:
        return f"{self.config.store_key}/name/{name}"

    def _read(self, name: str) -> LoRAModule | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(self._name_key(name), namespace=KV_NAMESPACE)
        if raw is None:
            return None
        value = json.loads(raw)
        return LoRAModule(value["base_model_name"], LoRARequest(name, value["id"], value["path"]))

    def _read_all(self) -> list[LoRAModule]:
        from ray.experimental.internal_kv import _internal_kv_list

        prefix = self._name_key("")
        names = sorted(key.decode()[len(prefix):] for key in _internal_kv_list(prefix, namespace=KV_NAMESPACE))
        return [m for m in map(self._read, names) if m is not None]  # (one unloaded meanwhile is left out)


def _kv_put(key: str, value: str) -> bool:
    """Puts key unless it exists; True if it existed (nothing written)."""
    from ray.experimental.internal_kv import _internal_kv_put

    return _internal_kv_put(key, value, overwrite=False, namespace=KV_NAMESPACE)


def _kv_del(key: str) -> bool:
    from ray.experimental.internal_kv import _internal_kv_del

    return _internal_kv_del(key, namespace=KV_NAMESPACE) > 0


def _duplicate(name: str) -> errors.InvalidRequestError:
    return errors.InvalidRequestError(f"a model or LoRA adapter named {name!r} is served already", "lora_name")
