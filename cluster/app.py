"""`build_app(args)`: a Serve config's `args` (or the CLI's flags) → a Serve `Application`.

    serve run deploy/serve.yaml        # import_path: cluster.app:build_app

    Ingress (ingress_replicas, num_cpus 0.1) ──handles by served_model_name──► LLMServer_<name> (one per model)

args are validated with pydantic (`AppArgs`); an unknown key or a bad value fails with the field named.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.actor_group import resolve_cluster_device
from cluster.ingress import Ingress
from cluster.router import DEFAULT_CHUNK_CHARS, DEFAULT_IMBALANCE_THRESHOLD, PrefixAffinityRouter
from cluster.server import LLMServer, replica_options

_ENGINE_FIELDS = ("model", "tensor_parallel_size", "max_model_len", "block_size", "max_num_seqs",
                  "max_num_batched_tokens", "gpu_memory_utilization", "enable_prefix_caching", "dtype",
                  "load_format", "device", "num_kv_blocks", "seed", "enforce_eager", "tokenizer", "chat_template")


class AutoscalingArgs(BaseModel):
    model_config = ConfigDict(extra="allow")  # any other Serve autoscaling option passes through

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class RouterArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunk_chars: int = Field(DEFAULT_CHUNK_CHARS, ge=1)
    imbalance_threshold: float = Field(DEFAULT_IMBALANCE_THRESHOLD, ge=0)


class ModelArgs(BaseModel):
    """One served model: the engine's settings, and how many replicas of it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None  # None: the built-in SmolLM2-135M-Instruct; "tiny": the tiny random model
    served_model_name: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    num_kv_blocks: int | None = Field(None, ge=1)
    seed: int = 0
    enforce_eager: bool = False
    tokenizer: str | None = None
    chat_template: str | None = None  # a file or the template itself: replaces the tokenizer's
    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: AutoscalingArgs | None = None
    max_ongoing_requests: int = Field(256, ge=1)  # per replica; beyond it the router queues (load signal)
    replica_num_cpus: float = Field(1.0, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    # A stream sends what accumulated at most this often (the first token and the end at once): fewer, larger
    # messages through Serve when many requests stream, as Ray Serve LLM's stream batching does. 0: every step.
    # Measured (H200, Llama-3-8B shape, all at once, engine in the replica, a client that kept 100 streams in
    # flight): 0.05 s gave 10.6k total tok/s, 0.1 s 18.0k.
    stream_interval_s: float = Field(0.1, ge=0)
    # The engine's step loop in a Ray actor of its own beside the replica (cluster/engine_core.py), so that it
    # does not share the replica's GIL with Serve's streaming. False: in the replica's process.
    engine_process: bool = True
    router: RouterArgs = RouterArgs()

    @model_validator(mode="after")
    def _check(self):
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        if self.served_model_name is None:
            self.served_model_name = _default_name(self.model)
        return self

    def engine_kwargs(self, device: str) -> dict[str, Any]:
        kwargs = {name: getattr(self, name) for name in _ENGINE_FIELDS}
        kwargs["device"] = device
        return kwargs


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelArgs] = Field(default_factory=lambda: [ModelArgs()], min_length=1)
    api_key: str | None = None
    ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.1, ge=0)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1)
    accept_timeout_s: float = Field(60.0, gt=0)
    debug: bool = False

    @model_validator(mode="after")
    def _check(self):
        names = [m.served_model_name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"served_model_name must be unique, repeated: {duplicates}")
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
    handles, cards = {}, {}
    for m in app_args.models:
        device = resolve_cluster_device(m.device)
        server = LLMServer.options(name=f"LLMServer_{_slug(m.served_model_name)}", **_server_options(m, device))
        handles[m.served_model_name] = server.bind(m.engine_kwargs(device), m.served_model_name,
                                                   m.graceful_shutdown_timeout_s, app_args.debug, m.stream_interval_s,
                                                   m.engine_process)
        cards[m.served_model_name] = {"root": m.model or _default_name(None)}
    config = {"api_key": app_args.api_key, "max_body_bytes": app_args.max_body_bytes,
              "accept_timeout_s": app_args.accept_timeout_s, "debug": app_args.debug}
    ingress = Ingress.options(num_replicas=app_args.ingress_replicas, max_ongoing_requests=10_000,
                              ray_actor_options={"num_cpus": app_args.ingress_num_cpus})
    return ingress.bind(handles, cards, config)


def _server_options(m: ModelArgs, device: str) -> dict[str, Any]:
    options = replica_options(m.tensor_parallel_size, device, m.replica_num_cpus, m.engine_process)
    if m.autoscaling_config is not None:
        options["autoscaling_config"] = m.autoscaling_config.model_dump()
    else:
        options["num_replicas"] = m.num_replicas or 1
    options.update(
        max_ongoing_requests=m.max_ongoing_requests, health_check_period_s=m.health_check_period_s,
        graceful_shutdown_timeout_s=m.graceful_shutdown_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs=m.router.model_dump()))
    return options


def _default_name(model: str | None) -> str:
    from engine.model_source import default_served_model_name

    return default_served_model_name(model)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
