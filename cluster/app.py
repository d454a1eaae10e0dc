"""`build_app(args)`: a Serve config's `args` (or the CLI's flags) → a Serve `Application`.

    serve run deploy/serve.yaml        # import_path: cluster.app:build_app

    Ingress (ingress_replicas) ──handles by served_model_name──► LLMServer_<name> (one deployment per model)

A model's args are flat: every `EngineArgs` field (engine/config.py, which holds their defaults) beside the serving
fields of `ModelArgs`. They are validated here, with the field named; an unknown key is an error.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.autoscaling import POLICY_PATH
from cluster.ingress import Ingress
from cluster.lora_registry import adapter_id
from cluster.placement import ReplicaPlacement, ingress_options
from cluster.ray_utils import resolve_cluster_device
from cluster.router import DEFAULT_CHUNK_CHARS, DEFAULT_IMBALANCE_THRESHOLD, PrefixAffinityRouter
from cluster.server import LLMServer, ServerSettings
from cluster.tool_parsers import TOOL_CALL_PARSERS
from engine import envs
from engine.config import EngineArgs
from engine.errors import ParamError
from engine.lora import LoRARequest

DEFAULT_STREAM_INTERVAL_S = 0.1
# A replica's max_ongoing_requests unless given: at least its engine's max_num_seqs (fewer would leave its batch
# part empty), and no fewer than 256. A replica at its max_ongoing_requests makes every other call to it wait for
# a slot too (/tokenize, the model's limits, and the /health and /metrics broadcasts, which then time out), so a
# small max_num_seqs keeps room: what does not fit in a step waits in the engine, whose waiting requests the
# autoscaling policy reads. A lower max_ongoing_requests makes requests wait in the ingress instead.
DEFAULT_MAX_ONGOING_REQUESTS = 256


class AutoscalingArgs(BaseModel):
    """Serve's autoscaling_config, and which policy decides (cluster/autoscaling.py): "pagoda" scales on the
    engines' KV-cache usage and waiting requests as well as ongoing requests; "ongoing_requests" is Serve's own."""

    model_config = ConfigDict(extra="allow")  # any other Serve autoscaling option passes through

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)
    policy: Literal["pagoda", "ongoing_requests"] = "pagoda"
    target_kv_cache_usage: float = Field(0.75, gt=0, le=1)
    target_waiting_requests: float = Field(0.0, ge=0)

    def serve_config(self) -> dict[str, Any]:
        config = self.model_dump(exclude={"policy", "target_kv_cache_usage", "target_waiting_requests"})
        if self.policy == "pagoda":
            config["policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": {
                "target_kv_cache_usage": self.target_kv_cache_usage,
                "target_waiting_requests": self.target_waiting_requests}}
        return config

    @model_validator(mode="after")
    def _check(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class RouterArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunk_chars: int = Field(DEFAULT_CHUNK_CHARS, ge=1)
    imbalance_threshold: float = Field(DEFAULT_IMBALANCE_THRESHOLD, ge=0)


class LoRAModuleArgs(BaseModel):
    """An adapter served by name from the start (vLLM's --lora-modules): a PEFT directory on every replica's node.
    base_model_name: the served name `/v1/models` gives as its parent (default: the model's first name)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: str | None = None


class ModelArgs(BaseModel):
    """One served model: its EngineArgs fields (flat, validated by EngineArgs) and how to serve it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), arbitrary_types_allowed=True)

    engine: EngineArgs = EngineArgs(stream_interval_s=DEFAULT_STREAM_INTERVAL_S)
    served_model_name: str | list[str] | None = None  # several: aliases of one model (the first is its name)
    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: AutoscalingArgs | None = None
    # Per replica: what its engine runs or queues (None: DEFAULT_MAX_ONGOING_REQUESTS, or max_num_seqs if more);
    # beyond it requests wait in the ingress replica's handle, up to max_queued_requests each; beyond those, a 429
    # with Retry-After (-1: no limit). The ingress counts both (cluster/request_run.py Admission).
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int = Field(1024, ge=-1)
    replica_num_cpus: float = Field(1.0, ge=0)
    replica_resources: dict[str, float] = Field(default_factory=dict)  # custom resources, e.g. {"model_slot": 1}
    accelerator_type: str | None = None  # e.g. "H100": replicas only on nodes with that accelerator
    replica_label_selector: dict[str, str] = Field(default_factory=dict)
    health_check_period_s: float = Field(10.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    # The engine's step loop in a Ray actor of its own beside the replica (cluster/engine_core.py), so that it
    # does not share the replica's GIL with Serve's streaming. False: in the replica's process.
    engine_process: bool = True
    engine_stall_timeout_s: float | None = Field(None, gt=0)  # None: $PAGODA_ENGINE_STALL_S (120 s unless set)
    allow_request_chat_template: bool = False
    chat_template_time_limit_s: float = Field(1.0, gt=0)
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = None  # tool_choice "auto"; None: the chat template's
    router: RouterArgs = RouterArgs()
    lora_modules: list[LoRAModuleArgs] = Field(default_factory=list)  # needs enable_lora

    @model_validator(mode="before")
    @classmethod
    def _engine_fields(cls, data):
        """The flat EngineArgs keys become `engine`; EngineArgs validates them (naming the field)."""
        if not isinstance(data, dict) or "engine" in data:
            return data
        names = set(EngineArgs.field_names())
        engine = {k: v for k, v in data.items() if k in names}
        engine.setdefault("stream_interval_s", DEFAULT_STREAM_INTERVAL_S)
        try:
            args = EngineArgs(**engine)
        except ParamError as e:
            raise ValueError(str(e)) from None
        except TypeError as e:
            raise ValueError(f"engine args: {e}") from None
        return {k: v for k, v in data.items() if k not in names} | {"engine": args}

    @model_validator(mode="after")
    def _check(self):
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        if self.served_model_name is None:
            self.served_model_name = _default_name(self.engine.model)
        if self.max_ongoing_requests is None:
            self.max_ongoing_requests = max(self.engine.max_num_seqs, DEFAULT_MAX_ONGOING_REQUESTS)
        if isinstance(self.served_model_name, list) and not self.served_model_name:
            raise ValueError("served_model_name must not be an empty list")
        self._check_lora_modules()
        return self

    def _check_lora_modules(self) -> None:
        if self.lora_modules and not self.engine.enable_lora:
            raise ValueError(f"lora_modules ({[m.name for m in self.lora_modules]}) need enable_lora: true")
        for m in self.lora_modules:
            if m.base_model_name is None:
                m.base_model_name = self.names[0]
            elif m.base_model_name not in self.names:
                raise ValueError(f"lora_modules: adapter {m.name!r} names base_model_name {m.base_model_name!r}, "
                                 f"which is not a name of its model ({self.names})")

    @property
    def max_prompts_at_once(self) -> int | None:
        """The most calls (one per prompt of a batch) Serve admits at once: every replica's max_ongoing_requests (at
        the most replicas there can be) plus the caller's queue. None: no queue limit."""
        if self.max_queued_requests == -1:
            return None
        replicas = self.autoscaling_config.max_replicas if self.autoscaling_config else self.num_replicas or 1
        return self.max_ongoing_requests * replicas + self.max_queued_requests

    @property
    def names(self) -> list[str]:
        name = self.served_model_name
        return list(name) if isinstance(name, list) else [name]

    def placement(self, device: str) -> ReplicaPlacement:
        return ReplicaPlacement(self.engine.tensor_parallel_size, device, self.replica_num_cpus, self.engine_process,
                                self.accelerator_type, dict(self.replica_resources), dict(self.replica_label_selector))


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelArgs] = Field(default_factory=lambda: [ModelArgs()], min_length=1)
    api_key: str | None = None
    ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.1, ge=0)
    ingress_resources: dict[str, float] = Field(default_factory=dict)  # e.g. {"head": 1}: ingress on the head
    ingress_label_selector: dict[str, str] = Field(default_factory=dict)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1)
    accept_timeout_s: float = Field(60.0, gt=0)
    default_max_tokens: int | None = Field(None, ge=1)  # chat without max_tokens; None: the rest of the context
    debug: bool = False  # /debug/integrity and /debug/fail_engine
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter; None: $PAGODA_ALLOW_RUNTIME_LORA_UPDATING
    allow_runtime_lora_updating: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        names = [name for m in self.models for name in m.names] + [a.name for m in self.models for a in m.lora_modules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"served_model_name and lora_modules names must be unique, repeated: {duplicates}")
        return self


def parse_args(args: dict | None) -> AppArgs:
    """Validates args; raises ValueError naming each bad field."""
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'args'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"invalid Pagoda app args: {problems}") from None


def build_app(args: dict | None = None) -> serve.Application:
    """The Serve application for `args` (see AppArgs; the shape of deploy/serve.yaml's `args`)."""
    app_args = parse_args(args)
    handles, cards, devices = {}, {}, set()
    for m in app_args.models:
        device = resolve_cluster_device(m.engine.device)
        devices.add(device)
        placement = m.placement(device)
        name = m.names[0]
        adapters = tuple(LoRARequest(a.name, adapter_id(a.name, a.path), a.path) for a in m.lora_modules)
        settings = ServerSettings(name, placement, drain_timeout_s=m.graceful_shutdown_timeout_s, debug=app_args.debug,
                                  allow_request_chat_template=m.allow_request_chat_template,
                                  chat_template_time_limit_s=m.chat_template_time_limit_s,
                                  engine_stall_timeout_s=m.engine_stall_timeout_s,
                                  tool_call_parser=m.tool_call_parser, lora_modules=adapters)
        server = LLMServer.options(name=f"LLMServer_{_slug(name)}", **_server_options(m, placement))
        handle = server.bind(replace(m.engine, device=device), settings)
        for alias in m.names:
            handles[alias] = handle
            cards[alias] = {"root": m.engine.model or _default_name(None)}
    config = {"api_key": app_args.api_key, "max_body_bytes": app_args.max_body_bytes,
              "accept_timeout_s": app_args.accept_timeout_s, "debug": app_args.debug,
              "default_max_tokens": app_args.default_max_tokens,
              "max_prompts": {alias: m.max_prompts_at_once for m in app_args.models for alias in m.names},
              "prepare_structured_outputs": "cuda" in devices, "lora": _lora_config(app_args)}
    # The ingress drains its streams for as long as the models drain theirs (Serve's default, 20 s, cut the
    # streams of a 30 s model drain), plus a margin for their last chunks.
    drain_s = max(m.graceful_shutdown_timeout_s for m in app_args.models) + 5.0
    ingress = Ingress.options(num_replicas=app_args.ingress_replicas, max_ongoing_requests=10_000,
                              graceful_shutdown_timeout_s=drain_s,
                              ray_actor_options=ingress_options(app_args.ingress_num_cpus, app_args.ingress_resources,
                                                                app_args.ingress_label_selector))
    return ingress.bind(handles, cards, config)


def _lora_config(app_args: AppArgs) -> dict[str, Any]:
    """What the ingress knows of adapters (cluster/lora_registry.py LoRAConfig's fields): those named at start, the
    models that take adapters at run time, and the key of the store of those loaded at run time (new at each build:
    a redeployed app starts from its lora_modules again)."""
    allow = app_args.allow_runtime_lora_updating
    if allow is None:
        allow = bool(envs.get("PAGODA_ALLOW_RUNTIME_LORA_UPDATING"))
    modules = [{"name": a.name, "id": adapter_id(a.name, a.path), "path": a.path, "base_model_name": a.base_model_name}
               for m in app_args.models for a in m.lora_modules]
    return {"modules": modules, "models": [m.names[0] for m in app_args.models if m.engine.enable_lora],
            "allow_runtime_updating": allow, "store_key": uuid.uuid4().hex}


def _server_options(m: ModelArgs, placement: ReplicaPlacement) -> dict[str, Any]:
    options = placement.replica_options()
    if m.autoscaling_config is not None:
        options["autoscaling_config"] = m.autoscaling_config.serve_config()
    else:
        options["num_replicas"] = m.num_replicas or 1
    # Serve's own queue limit stays off: its router counts the requests it is still routing as queued, so it
    # refused a varying part of a burst that the replicas had room for; the ingress admits exactly (Admission).
    options.update(
        max_ongoing_requests=m.max_ongoing_requests, max_queued_requests=-1,
        health_check_period_s=m.health_check_period_s, graceful_shutdown_timeout_s=m.graceful_shutdown_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs=m.router.model_dump()))
    return options


def _default_name(model: str | None) -> str:
    from checkpoints.source import default_served_model_name

    return default_served_model_name(model)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
