"""`LLMServer`: the Serve deployment of one model copy. One replica = one `AsyncLLMEngine`.

    Ingress ──handle.options(stream=True).generate.remote(GenerateRequest)──► LLMServer.generate
                                                                               │ validate, chat template
      ◄── StepDelta(accepted) ◄────────────────────────────────────────────────┤
      ◄── StepDelta(new text, tokens, logprobs) per engine step ◄──────────────┘ AsyncLLMEngine.generate

Placement is derived in one place, `replica_options`: tensor_parallel_size 1 is a plain replica with the engine
(and its worker) in-process; more ranks get a placement group from `cluster.actor_group.placement_bundles`, whose
bundles the engine's RayExecutor fills with worker actors (the replica never creates a nested group).

A bad request never raises across the Serve boundary: it comes back as a `StepDelta` carrying an `ErrorInfo`.
A client that goes away cancels the ingress's handle generator; Serve cancels `generate` here, which closes the
engine's generator, whose `finally` aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict

from ray import serve

from cluster.errors import ErrorInfo, error_from_value_error
from cluster.metrics import ReplicaMetrics
from cluster.protocol import ChoiceDelta, GenerateRequest, StepDelta, TokenLogprob
from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.request_output import CompletionOutput, RequestOutput
from engine.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

METRICS_SYNC_PERIOD_S = 1.0


def replica_options(tensor_parallel_size: int, device: str, num_cpus: float, engine_process: bool = True) -> dict:
    """Serve deployment options that place one replica (`device` already resolved to "cpu" or "cuda").

    With the engine in an actor of its own on one GPU, the replica reserves that GPU in its placement group
    (bundle 0: its CPUs and the GPU) and the engine actor takes it."""
    if tensor_parallel_size == 1:
        if engine_process and device == "cuda":
            bundle = {"CPU": num_cpus, "GPU": 1} if num_cpus > 0 else {"GPU": 1}
            return {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": 0},
                    "placement_group_bundles": [bundle], "placement_group_strategy": "STRICT_PACK"}
        return {"ray_actor_options": {"num_cpus": num_cpus,
                                      "num_gpus": 1 if device == "cuda" and not engine_process else 0}}
    from cluster.actor_group import PLACEMENT_STRATEGY, placement_bundles
    from engine.config import ParallelConfig

    bundles = placement_bundles(ParallelConfig(tensor_parallel_size=tensor_parallel_size, device=device), device)
    # The replica (the driver) lives in bundle 0 beside rank 0; the worker actors take the GPUs.
    return {"ray_actor_options": {"num_cpus": bundles[0].get("CPU", 0), "num_gpus": 0},
            "placement_group_bundles": bundles, "placement_group_strategy": PLACEMENT_STRATEGY}


@serve.deployment(name="LLMServer")
class LLMServer:
    def __init__(self, engine_kwargs: dict, served_model_name: str, drain_timeout_s: float = 30.0,
                 debug: bool = False, stream_interval_s: float = 0.0, engine_process: bool = True):
        self.model_name = served_model_name
        self.stream_interval_s = stream_interval_s
        self.replica_id = _replica_tag()
        self.drain_timeout_s = drain_timeout_s
        self.debug = debug
        if engine_process:  # the step loop in an actor of its own (cluster/engine_core.py)
            from cluster.engine_core import RemoteAsyncEngine, core_actor_options

            self.engine = RemoteAsyncEngine(engine_kwargs, core_actor_options(engine_kwargs),
                                            output_interval_s=stream_interval_s / 4)
        else:
            self.engine = AsyncLLMEngine.from_args(**engine_kwargs)
        self.metrics = ReplicaMetrics(served_model_name, self.replica_id)
        self._token_strings: dict[int, str] = {}
        self._num_in_flight = 0
        self._closed = threading.Event()
        self._metrics_thread = threading.Thread(target=self._sync_metrics_loop, name="pagoda-metrics", daemon=True)
        self._metrics_thread.start()
        logger.info("replica %s of %s ready (max_model_len %d)", self.replica_id, self.model_name,
                    self.engine.max_model_len)

    # ---- the request path --------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepDelta]:
        """Yields an accepted (or error) delta, then one delta per engine step that moved (only the final one when
        `request.stream` is false)."""
        try:
            text, token_ids = self._process(request)
        except ValueError as e:
            yield StepDelta(self.replica_id, finished=True, error=error_from_value_error(e))
            return
        except EngineDeadError as e:
            yield StepDelta(self.replica_id, finished=True, error=ErrorInfo(503, f"the engine is not running: {e}"))
            return
        except Exception as e:  # a bug, not the client's fault: answer 500 and keep serving
            logger.exception("request %s failed before it started", request.request_id)
            yield StepDelta(self.replica_id, finished=True, error=ErrorInfo(500, f"{type(e).__name__}: {e}"))
            return
        prompt_text = (text if text is not None else self._decode(token_ids)) if request.echo else None
        yield StepDelta(self.replica_id, prompt_tokens=len(token_ids), accepted=True, prompt_text=prompt_text)
        self._num_in_flight += 1
        try:
            async for delta in self._stream(request, text, token_ids):
                yield delta
        finally:
            self._num_in_flight -= 1

    def _process(self, request: GenerateRequest) -> tuple[str | None, list[int]]:
        self.engine.check_health()
        prompt = request.prompt
        if request.messages is not None:
            text = apply_chat_template(self.engine.tokenizer, request.messages, request.add_generation_prompt,
                                       **(request.chat_template_kwargs or {}))
            prompt = {"prompt": text, "add_special_tokens": False}
        if prompt is None:
            raise ValueError("prompt is missing")
        text, token_ids = self.engine.process_prompt(prompt, request.params)
        max_tokens, limit = request.params.max_tokens, self.engine.max_model_len
        if max_tokens is not None and len(token_ids) + max_tokens > limit:  # as OpenAI and vLLM's server answer
            raise ValueError(f"max_tokens is too large: this model's maximum context length is {limit} tokens, "
                             f"and the prompt takes {len(token_ids)} of them plus {max_tokens} requested")
        return text, token_ids

    async def _stream(self, request: GenerateRequest, text: str | None,
                      token_ids: list[int]) -> AsyncIterator[StepDelta]:
        params = request.params
        streams = [_ChoiceStream(i, params.logprobs) for i in range(params.n)]
        final = StepDelta(self.replica_id, choices=[ChoiceDelta(i, logprobs=None) for i in range(params.n)])
        last_token_time, finished = None, False
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        try:
            # Streams get an output at most once per stream_interval_s (carrying every token since the last), so
            # a few hundred streams wake this event loop a few times a second each, not at every engine step.
            generator = self.engine.generate(prompt, params, request.request_id, final_only=not request.stream,
                                             interval_s=self.stream_interval_s if request.stream else 0.0)
            async with contextlib.aclosing(generator) as outputs:
                async for out in outputs:
                    last_token_time = self._observe_step(out, last_token_time, streams)
                    finished = out.finished
                    if out.error is not None:
                        yield StepDelta(self.replica_id, finished=True, error=_engine_error(self.engine, out.error))
                        return
                    delta = StepDelta(self.replica_id, finished=out.finished,
                                      choices=[c for c in (s.advance(o, self._token_string)
                                                           for s, o in zip(streams, out.outputs)) if c is not None])
                    if not request.stream:
                        for choice in delta.choices:
                            final.choices[choice.index].merge(choice)
                    elif delta.choices or delta.finished:
                        yield delta
            if not request.stream:
                final.finished = True
                yield final
        except EngineDeadError as e:
            yield StepDelta(self.replica_id, finished=True, error=ErrorInfo(503, f"the engine is not running: {e}"))
        finally:
            if not finished:
                self.metrics.observe_finished("abort", None)

    def _observe_step(self, out: RequestOutput, last_token_time: float | None,
                      streams: list[_ChoiceStream]) -> float | None:
        now = time.monotonic()
        m = out.metrics
        if last_token_time is None and m is not None and m.first_token_time is not None:
            self.metrics.observe_first_token(m.first_token_time - m.arrival_time)
            last_token_time = now
        elif last_token_time is not None:
            # Outputs may carry several new tokens (coalesced): each gets its share of the interval.
            new_tokens = max([len(o.token_ids) - s.num_sent_tokens for s, o in zip(streams, out.outputs)] + [1])
            for _ in range(new_tokens):
                self.metrics.observe_inter_token((now - last_token_time) / new_tokens)
            last_token_time = now
        if out.finished:
            reason = "error" if out.error else (out.outputs[0].finish_reason if out.outputs else None) or "stop"
            e2e = (m.finish_time or now) - m.arrival_time if m is not None else None
            self.metrics.observe_finished(reason, e2e)
        return last_token_time

    # ---- tokenizer endpoints -------------------------------------------------------------------------------------
    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       add_special_tokens: bool = True, add_generation_prompt: bool = True) -> dict | ErrorInfo:
        try:
            if messages is not None:
                prompt = apply_chat_template(self.engine.tokenizer, messages, add_generation_prompt)
                add_special_tokens = False
            if prompt is None:
                raise ValueError("prompt or messages is required")
            tokens = self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except ValueError as e:
            return error_from_value_error(e)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, tokens: list[int]) -> dict | ErrorInfo:
        vocab_size = self.engine.vocab_size
        if any(not 0 <= t < vocab_size for t in tokens):
            return ErrorInfo(400, f"tokens must be token ids in [0, {vocab_size})", "tokens")
        return {"prompt": self._decode(tokens)}

    def model_info(self) -> dict:
        return {"max_model_len": self.engine.max_model_len, "replica": self.replica_id}

    # ---- control plane (broadcast by the ingress) -----------------------------------------------------------------
    def collect_metrics(self):
        self.metrics.sync_engine_stats(self.engine.get_stats())
        return self.metrics.snapshot()

    async def check_integrity(self) -> dict:
        """Runs the block manager's invariants between steps; reports instead of raising."""
        try:
            await self.engine.check_integrity()
            error = None
        except Exception as e:  # an integrity failure is data for the caller, not a replica crash
            error = f"{type(e).__name__}: {e}"
        return {"replica": self.replica_id, "ok": error is None, "error": error,
                "stats": asdict(self.engine.get_stats())}

    def fail_engine(self, reason: str = "failed by /debug/fail_engine") -> dict:
        """Debug only (app arg `debug: true`): marks the engine dead, as a crashed step would."""
        if not self.debug:
            return {"replica": self.replica_id, "failed": False}
        self.engine.dead_error = reason
        return {"replica": self.replica_id, "failed": True}

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica. The engine loop checks the
        workers after every step; this also catches a worker that died while the engine was idle (in a thread:
        a Ray executor may ping its actors)."""
        self.engine.check_health()
        await asyncio.to_thread(self.engine.check_executor)

    async def __del__(self):
        """Serve drains ongoing requests first (graceful_shutdown_timeout_s); this bounds what is left, then stops
        the engine. Called once by Serve."""
        if self._closed.is_set():
            return
        self._closed.set()
        deadline = time.monotonic() + self.drain_timeout_s
        while self._num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self._num_in_flight:
            logger.warning("shutting down with %d requests in flight", self._num_in_flight)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _sync_metrics_loop(self) -> None:
        while not self._closed.wait(METRICS_SYNC_PERIOD_S):
            try:
                self.metrics.sync_engine_stats(self.engine.get_stats())
            except Exception:  # metrics must never take the replica down
                logger.exception("metrics sync failed")

    def _decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _token_string(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
            self._token_strings[token_id] = text
        return text


class _ChoiceStream:
    """Turns one completion's cumulative output into deltas. The engine already holds back, while a request runs,
    the text that a stop string could still cut (CompletionOutput.text only grows)."""

    def __init__(self, index: int, num_logprobs: int | None):
        self.index = index
        self.num_logprobs = num_logprobs
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.is_done = False

    def advance(self, out: CompletionOutput, token_string) -> ChoiceDelta | None:
        if self.is_done:
            return None
        finished = out.finish_reason is not None
        text = out.text[self.num_sent_chars:]
        self.num_sent_chars = max(len(out.text), self.num_sent_chars)
        new_ids = out.token_ids[self.num_sent_tokens:]
        logprobs = None
        if self.num_logprobs is not None and out.logprobs is not None:
            entries = out.logprobs[self.num_sent_tokens:self.num_sent_tokens + len(new_ids)]
            logprobs = [_token_logprob(t, e, self.num_logprobs, token_string) for t, e in zip(new_ids, entries)]
        self.num_sent_tokens += len(new_ids)
        self.is_done = finished
        if not text and not new_ids and not finished:
            return None
        return ChoiceDelta(self.index, text, len(new_ids), logprobs, out.finish_reason if finished else None,
                           out.stop_reason if finished else None)


def _token_logprob(token_id: int, entry: dict[int, float], k: int, token_string) -> TokenLogprob:
    best = sorted(entry.items(), key=lambda item: -item[1])[:k]
    return TokenLogprob(token_string(token_id), float(entry.get(token_id, float("nan"))),
                        [(token_string(t), float(lp)) for t, lp in best])


def _engine_error(engine: AsyncLLMEngine, message: str) -> ErrorInfo:
    if engine.dead_error is not None:
        return ErrorInfo(503, f"the engine is not running: {engine.dead_error}")
    return ErrorInfo(500, f"the engine failed this request: {message}")


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_tag
    except Exception:  # outside Serve (unit tests construct the class directly)
        return "local"
