"""`LLMServer`: the Serve deployment of one model copy. One replica = one `AsyncLLMEngine`.

    Ingress ──handle.options(stream=True).generate.remote(GenerateRequest)──► LLMServer.generate
      ◄── Accepted ◄── validate: chat template, bounded tokenization (a thread: the event loop stays free)
      ◄── list[RequestDelta], as the engine's polls bring them ◄── AsyncLLMEngine.generate

Where the replica and its actors run is cluster/placement.py's business; the engine runs in an actor of its own
(cluster/engine_core.py) unless `engine_process` is off. A bad request never raises across the Serve boundary: it
comes back as an `ErrorInfo`. A client that goes away cancels the ingress's handle generator; Serve cancels
`generate` here, which closes the engine's generator, whose `finally` aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from ray import serve

from cluster.autoscaling import autoscaling_stats
from cluster.errors import ErrorInfo
from cluster.executors import pick_executor
from cluster.metrics import ReplicaMetrics
from cluster.placement import ReplicaPlacement
from cluster.protocol import Accepted, GenerateRequest, TokenizeInput, error_info
from cluster.router import routing_stats
from cluster.tool_parsers import tool_parser_for_template
from engine.async_engine import AsyncLLMEngine, LocalConnection
from engine.config import EngineArgs, resolve_device
from engine.errors import EngineDeadError, ParamError
from engine.lora import LoRARequest, read_adapter
from engine.request_output import RequestDelta
from engine.sampling_params import default_sampling_overrides
from engine.structured_outputs import import_in_background
from engine.tokenizer import RESERVED_TEMPLATE_KWARGS, apply_chat_template

logger = logging.getLogger(__name__)

METRICS_SYNC_PERIOD_S = 1.0


@dataclass(frozen=True)
class ServerSettings:
    """A replica's serving settings (the app args of its model, cluster/app.py)."""

    served_model_name: str
    placement: ReplicaPlacement
    drain_timeout_s: float = 30.0
    debug: bool = False
    allow_request_chat_template: bool = False  # chat_template_kwargs.chat_template: a client's template runs here
    chat_template_time_limit_s: float = 1.0  # ... for at most this long
    engine_stall_timeout_s: float | None = None  # requests in flight, no step this long: unhealthy (None: the env's)
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls in this format; None: the chat template's
    lora_modules: tuple[LoRARequest, ...] = ()  # adapters given at start: checked before the replica serves


@serve.deployment(name="LLMServer")
class LLMServer:
    def __init__(self, engine_args: EngineArgs, settings: ServerSettings):
        placed = time.time()  # the replica's actor runs: its resources were granted
        self.settings = settings
        self.model_name = settings.served_model_name
        self.replica_id = _replica_tag()
        config = engine_args.create_engine_config()
        # A GPU model's replica imports xgrammar as it starts, as its engine and ingress do: each request's constraint
        # is built here too (`_prepare`), and the first constrained request paid the import (2 s of CPU here)
        self.xgrammar_import = import_in_background() if resolve_device(config.parallel.device) == "cuda" else None
        for lora in settings.lora_modules:  # a bad adapter stops the replica (so the app) from starting
            try:
                read_adapter(lora, config.model.hf_config, config.lora.max_lora_rank)
            except ParamError as e:
                raise ValueError(f"lora_modules: {e.message}") from None
        if settings.placement.engine_process:
            from cluster.engine_core import RayConnection
            from cluster.ray_utils import actor_env_vars

            options = settings.placement.engine_actor_options(actor_env_vars())
            connection = RayConnection(config, options | {"name": f"EngineCore:{_replica_name()}"})
        else:
            connection = LocalConnection(config, pick_executor)
        self.engine = AsyncLLMEngine(config, connection, settings.engine_stall_timeout_s)
        self.metrics = ReplicaMetrics(self.model_name, self.replica_id)
        self._num_in_flight = 0
        self._closed = threading.Event()
        self._metrics_thread = threading.Thread(target=self._sync_metrics_loop, name="pagoda-metrics", daemon=True)
        self._metrics_thread.start()
        self.ready_after_s = time.time() - placed
        startup = self.engine.startup
        logger.info("replica %s of %s ready (max_model_len %d) %.1f s after its __init__ began; engine start-up: "
                    "%s", self.replica_id, self.model_name, self.engine.max_model_len, self.ready_after_s,
                    startup.describe() if startup else "not reported")

    # ---- the request path --------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Accepted | list[RequestDelta] | ErrorInfo]:
        """Yields Accepted (or an ErrorInfo, and stops), then the request's deltas in batches; the last batch ends
        with the finished delta."""
        try:
            self.engine.check_health()
            text, token_ids = await asyncio.to_thread(self._prepare, request)
        except ParamError as e:
            yield error_info(e)
            return
        except EngineDeadError:
            yield ErrorInfo(503, "the model's engine is restarting; retry shortly")
            return
        except Exception:  # a bug, not the client's fault: answer 500, log it, keep serving
            logger.exception("request %s failed before it started", request.request_id)
            yield ErrorInfo(500, "internal error while preparing the request")
            return
        yield Accepted(self.replica_id, len(token_ids), self._prompt_text(text, token_ids) if request.echo else None,
                       token_ids if request.return_token_ids else None)
        self._num_in_flight += 1
        try:
            async for batch in self._stream(request, token_ids):
                yield batch
        finally:
            self._num_in_flight -= 1

    def _prepare(self, request: GenerateRequest) -> tuple[str | None, list[int]]:
        """Chat template, tokenization and validation (blocking: runs in a thread)."""
        prompt = request.prompt
        if request.messages is not None:
            prompt = {"prompt": self._render(request), "add_special_tokens": False}
        if prompt is None:
            raise ParamError("prompt", "is missing")
        text, token_ids = self.engine.process_prompt(prompt, request.params)
        max_tokens, limit = request.params.max_tokens, self.engine.max_model_len
        if max_tokens is not None and len(token_ids) + max_tokens > limit:  # as OpenAI and vLLM's server answer
            raise ParamError("max_tokens", f"is too large: this model's maximum context length is {limit} tokens, "
                                           f"and the prompt takes {len(token_ids)} of them plus {max_tokens} requested")
        return text, token_ids

    def _render(self, request: GenerateRequest | TokenizeInput) -> str:
        kwargs = dict(request.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None)
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ParamError("chat_template_kwargs", f"may not set {reserved}: the request's own fields do")
        if template is not None and not self.settings.allow_request_chat_template:
            raise ParamError("chat_template_kwargs", "chat_template is not allowed on this server (the operator can "
                                                     "allow it: app arg allow_request_chat_template)")
        limit = self.settings.chat_template_time_limit_s if template is not None else None
        # (continue_final_message: the last message stays open, the model continues it)
        return apply_chat_template(self.engine.tokenizer, request.messages, request.add_generation_prompt,
                                   template, time_limit_s=limit, tools=request.tools,
                                   continue_final_message=bool(request.continue_final_message),
                                   template_kwargs=kwargs)

    async def _stream(self, request: GenerateRequest, token_ids: list[int],
                      ) -> AsyncIterator[list[RequestDelta] | ErrorInfo]:
        arrival = request.arrival_time or time.time()
        last_token_time, finished = None, False
        try:
            generator = self.engine.generate(token_ids, request.params, request.request_id, request.stream, arrival,
                                             request.lora_request)
            lora_name = request.lora_request.name if request.lora_request is not None else None
            async with contextlib.aclosing(generator) as batches:
                async for batch in batches:
                    last_token_time = self._observe(batch, arrival, last_token_time, lora_name)
                    finished = batch[-1].finished
                    yield batch
        except EngineDeadError:
            yield ErrorInfo(503, "the model's engine stopped; retry shortly")
        finally:
            if not finished:
                self.metrics.observe_finished("abort", time.time() - arrival,
                                              lora_name=request.lora_request and request.lora_request.name)

    def _observe(self, batch: list[RequestDelta], arrival: float, last_token_time: float | None,
                 lora_name: str | None = None) -> float | None:
        now = time.time()
        new_tokens = sum(d.num_new_tokens for d in batch)
        if new_tokens and last_token_time is None:
            self.metrics.observe_first_token(now - arrival)
            last_token_time = now
        elif new_tokens:  # a batch may carry several tokens: each gets its share of the interval
            self.metrics.observe_inter_token((now - last_token_time) / new_tokens, new_tokens)
            last_token_time = now
        last = batch[-1]
        if last.finished:
            reason = "error" if last.error else next((s.finish_reason for s in last.seqs if s.finish_reason), "stop")
            self.metrics.observe_finished(reason, now - arrival, last.metrics, lora_name)
        return last_token_time

    # ---- tokenizer endpoints -------------------------------------------------------------------------------------
    async def tokenize(self, request: TokenizeInput) -> dict | ErrorInfo:
        """vLLM's /tokenize: the prompt's token ids, or those of the messages rendered as a chat would be."""
        def run():
            text, param = request.prompt, "prompt"
            if request.messages is not None:
                text, param = self._render(request), "messages"
            if text is None:
                raise ParamError("prompt", "or messages is required")
            if len(text) > self.engine.limits.max_prompt_chars:
                raise ParamError(param, f"is longer than this model's context ({len(text)} characters)")
            tokens = self.engine.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
            strings = self.engine.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
            return tokens, strings

        try:
            tokens, strings = await asyncio.to_thread(run)
        except ParamError as e:
            return error_info(e)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len,
                "token_strs": strings}

    async def detokenize(self, tokens: list[int]) -> dict | ErrorInfo:
        vocab_size = self.engine.vocab_size
        if any(not 0 <= t < vocab_size for t in tokens):
            return ErrorInfo(400, f"tokens must be token ids in [0, {vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(self._decode, tokens)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info (lm-eval's remote tokenizer reads it): the tokenizer's configuration as its
        tokenizer_config.json gives it, less file paths, with its class and the chat template served."""
        tokenizer = self.engine.tokenizer
        config = {key: value for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if not key.endswith("_file") and key != "name_or_path"}
        info = _json_safe(config)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if info.get(name) is None and getattr(tokenizer, name, None) is not None:
                info[name] = str(getattr(tokenizer, name))
        info["tokenizer_class"] = type(tokenizer).__name__
        if getattr(tokenizer, "chat_template", None):
            info["chat_template"] = tokenizer.chat_template
        return info

    def model_info(self) -> dict:
        parser = self.settings.tool_call_parser or tool_parser_for_template(self.engine.tokenizer.chat_template)
        limits = self.engine.limits
        return {"max_model_len": self.engine.max_model_len, "max_prompt_chars": limits.max_prompt_chars,
                "vocab_size": limits.vocab_size, "max_num_seqs": limits.max_num_seqs,
                "sampling_defaults": default_sampling_overrides(self.engine.config.model), "replica": self.replica_id,
                "tool_call_parser": parser, "allow_request_chat_template": self.settings.allow_request_chat_template}

    # ---- control plane (broadcast by the ingress) -----------------------------------------------------------------
    async def check_lora_adapter(self, lora: LoRARequest) -> ErrorInfo | None:
        """/v1/load_lora_adapter asks every replica: can this adapter run here (its files, on this node, fit the
        model)? None, or a 400 naming it. Nothing is loaded: the engine reads it when its first request comes."""
        config = self.engine.config
        if config.lora is None:
            return ErrorInfo(400, f"{self.model_name!r} takes no LoRA adapters (start it with enable_lora)", "model")
        try:
            await asyncio.to_thread(read_adapter, lora, config.model.hf_config, config.lora.max_lora_rank)
        except ParamError as e:
            return ErrorInfo(400, e.message, "lora_path")
        return None

    def collect_metrics(self):
        self._sync_metrics()
        return self.metrics.snapshot()

    async def check_integrity(self) -> dict:
        """Runs the block manager's invariants between steps; reports instead of raising."""
        try:
            await self.engine.check_integrity()
            error = None
        except Exception as e:  # noqa: BLE001 - an integrity failure is data for the caller, not a replica crash
            error = f"{type(e).__name__}: {e}"
        return {"replica": self.replica_id, "ok": error is None, "error": error,
                "stats": asdict(self.engine.get_stats())}

    def fail_engine(self, reason: str = "failed by /debug/fail_engine") -> dict:
        """Debug only (app arg `debug: true`): the engine dies as a crashed step would."""
        if not self.settings.debug:
            return {"replica": self.replica_id, "failed": False}
        self.engine.fail(reason)
        return {"replica": self.replica_id, "failed": True}

    def record_routing_stats(self) -> dict[str, int]:
        """Serve's routing stats, which the prefix-affinity router reads (cluster/router.py): this replica's cache
        capacity, device pool and host KV tier."""
        return routing_stats(self.engine.get_stats(), self.engine.config.cache.block_size)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (cluster/autoscaling.py reads them)."""
        return autoscaling_stats(self.engine.get_stats())

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica. Besides a dead engine, it catches
        one that stopped making progress, and a worker that died while the engine was idle (in a thread)."""
        self.engine.check_health()
        await asyncio.to_thread(self.engine.check_executor)

    async def __del__(self):
        """Serve drains ongoing requests first (graceful_shutdown_timeout_s); this bounds what is left, then stops
        the engine. Called once by Serve."""
        if self._closed.is_set():
            return
        self._closed.set()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self._num_in_flight:
            logger.warning("shutting down with %d requests in flight", self._num_in_flight)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _sync_metrics(self) -> None:
        self.metrics.sync_engine_stats(self.engine.get_stats())
        self.metrics.observe_steps(self.engine.take_step_tokens())

    def _sync_metrics_loop(self) -> None:
        while not self._closed.wait(METRICS_SYNC_PERIOD_S):
            try:
                self._sync_metrics()
            except Exception:  # metrics must never take the replica down
                logger.exception("metrics sync failed")

    def _prompt_text(self, text: str | None, token_ids: list[int]) -> str:
        return text if text is not None else self._decode(token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)


def _json_safe(value):
    """A tokenizer's configuration as JSON: special tokens (AddedToken) as their text, other objects as strings."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _replica_name() -> str:
    """app#deployment#tag: the engine actor is named after its replica (`ray list actors` shows which is whose)."""
    try:
        deployment = serve.get_replica_context().replica_id.deployment_id
        return f"{deployment.app_name}#{deployment.name}#{_replica_tag()}"
    except Exception:  # noqa: BLE001 - outside Serve
        return _replica_tag()


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_tag
    except Exception:  # noqa: BLE001 - outside Serve (unit tests construct the class directly)
        return "local"
