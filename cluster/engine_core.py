"""The engine in a process of its own: a Ray actor beside the Serve replica.

    replica process (Serve, asyncio)                   EngineCore actor (its own process, its own GIL)
    RemoteAsyncEngine.generate ── add (one-way) ──►    EngineLoop: step thread, scheduler, detokenizer, workers
          ▲                                                  │ every step's outputs
          └──── poll(): new tokens/text of every request ◄── outbox: the newest output of each request

In one process the step thread and Serve's streaming share the GIL: with a few hundred streams the step thread
waits for it and the GPU idles. Here the replica only validates requests, applies deltas and streams. A poll
returns, for every request that moved since the last one, only what is new (tokens, text, logprobs), so its size
does not grow with the outputs' length. The actor belongs to the replica (it dies with it) and sits in the
replica's placement group: on tensor_parallel_size 1 it holds the GPU, on more it drives the worker actors.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import ray

from engine.async_engine import EngineDeadError, EngineLoop, OutputStreams
from engine.llm_engine import EngineStats, LLMEngine, Prompt, process_prompt
from engine.request_output import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0  # an idle poll returns after this long (stats stay fresh, the replica notices a dead actor)
START_TIMEOUT_S = 1800.0  # loading a large model
CALL_TIMEOUT_S = 60.0
MAX_EARLY_ABORTS = 10_000

# One poll's entry for a request: (request_id, finished, error, metrics, choices), a choice being
# (index, new text, new token ids, new logprobs or None, finish_reason, stop_reason, cumulative_logprob).
Delta = tuple


class EngineCore:
    """The Ray actor (created with `core_actor_class`). Control calls run one at a time, in order; polls and
    health checks have threads of their own."""

    def __init__(self, engine_kwargs: dict, output_interval_s: float = 0.0):
        self.engine = LLMEngine.from_args(**engine_kwargs)
        self.engine.delta_outputs = True  # each output holds only the news since the request's last one
        # Building and shipping an output costs the step thread ~10 us per request: at 256 streams and 10 ms steps,
        # one per request and step made the host, not the GPU, set the pace. The replica streams at most once per
        # its stream interval anyway, so it asks for outputs a few times per interval (first tokens and ends
        # still come at once).
        self.engine.output_interval_s = output_interval_s
        self._cond = threading.Condition()
        self._outbox: dict[str, RequestOutput] = {}  # request -> everything new since the last poll
        self._ids_lock = threading.Lock()  # guards the two below (control and poll threads)
        self._known: set[str] = set()  # added, not yet finished or aborted
        self._aborted_first: OrderedDict[str, None] = OrderedDict()  # aborts that came before their add (bounded)
        self.loop = EngineLoop(self.engine, self._on_outputs, self._on_dead)
        self.loop.start()

    # ---- control (one thread, in order) ------------------------------------------------------------------------
    def info(self) -> dict:
        config = self.engine.config
        return {"max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "max_num_seqs": config.scheduler.max_num_seqs, "tokenizer_path": config.model.tokenizer_path,
                "chat_template": config.model.chat_template,
                "stats": self.loop.stats}

    def add(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams) -> None:
        with self._ids_lock:
            if request_id in self._aborted_first:  # its abort overtook it: the client is gone already
                del self._aborted_first[request_id]
                return
            self._known.add(request_id)
        self.loop.add(request_id, text, token_ids, params, lambda e: self._on_outputs(
            [RequestOutput(request_id, text, token_ids, finished=True, error=f"{type(e).__name__}: {e}")]))

    def abort(self, request_id: str) -> None:
        with self._ids_lock:
            if request_id not in self._known:  # not added yet, or finished already: then this is harmless
                self._aborted_first[request_id] = None
                while len(self._aborted_first) > MAX_EARLY_ABORTS:
                    self._aborted_first.popitem(last=False)
                return
            self._known.discard(request_id)
        self.loop.abort(request_id)

    def apply(self, ops: list[tuple]) -> None:
        """Several adds and aborts in one call, in order: ("add", request_id, text, token_ids, params) or
        ("abort", request_id). The replica sends what one turn of its event loop queued (a burst of requests is
        a few calls, not one each)."""
        for op in ops:
            if op[0] == "add":
                self.add(*op[1:])
            elif op[0] == "abort":
                self.abort(op[1])
            else:
                raise ValueError(f"unknown engine operation {op[0]!r}")

    def check_integrity(self) -> None:
        """Runs the block manager's invariants between two steps; raises what they raise."""
        done, failure = threading.Event(), []

        def run():
            try:
                self.engine.check_integrity()
            except BaseException as e:  # reported to the caller
                failure.append(e)
            done.set()

        self.loop.submit(run)
        if not done.wait(CALL_TIMEOUT_S):
            raise TimeoutError("the engine loop did not run the integrity check")
        if failure:
            raise failure[0]

    def shutdown(self) -> None:
        self.loop.shutdown()
        with self._cond:
            self._cond.notify_all()

    # ---- polls and health (threads of their own) ---------------------------------------------------------------
    def poll(self, timeout_s: float = POLL_TIMEOUT_S) -> tuple[list[Delta], EngineStats, str | None]:
        """What every request produced since the last poll (waits up to timeout_s for something), the latest
        stats, and the loop's fatal error if it died."""
        with self._cond:
            if not self._outbox and self.loop.dead_error is None:
                self._cond.wait(timeout_s)
            outputs, self._outbox = self._outbox, {}
        with self._ids_lock:  # an aborted request's last outputs are dropped, and leave no bookkeeping behind
            deltas = [self._delta(out) for out in outputs.values() if out.request_id in self._known]
        return deltas, self.loop.stats, self.loop.dead_error

    def check_health(self) -> None:
        self.loop.check_health()
        self.engine.executor.check_health()

    # ---- the step thread's side -----------------------------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            for out in outputs:
                earlier = self._outbox.get(out.request_id)
                self._outbox[out.request_id] = out if earlier is None else _merge(earlier, out)
            self._cond.notify_all()

    def _on_dead(self, error: str) -> None:
        with self._cond:
            self._cond.notify_all()

    def _delta(self, out: RequestOutput) -> Delta:
        if out.finished:
            self._known.discard(out.request_id)
        choices = [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.cumulative_logprob)
                   for c in out.outputs]
        return out.request_id, out.finished, out.error, out.metrics, choices


def _merge(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two delta outputs of one request as one: the news of both, the later one's state."""
    by_index = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        e = by_index.get(c.index)
        if e is not None:
            c.text = e.text + c.text
            c.token_ids = e.token_ids + c.token_ids
            if c.logprobs is not None and e.logprobs is not None:
                c.logprobs = e.logprobs + c.logprobs
    return later


def core_actor_class():
    """EngineCore as a Ray actor class: control calls in order on one thread; polls and health pings apart."""
    return ray.remote(concurrency_groups={"control": 1, "poll": 1, "health": 1})(EngineCore)


def core_actor_options(engine_kwargs: dict) -> dict:
    """Where the engine actor runs: in the caller's placement group (bundle 0, the replica's own), holding the
    GPU itself on tensor_parallel_size 1 (more ranks are worker actors in the other bundles)."""
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    from cluster.actor_group import actor_env_vars

    on_gpu = engine_kwargs.get("device") == "cuda" and engine_kwargs.get("tensor_parallel_size", 1) == 1
    options = {"num_cpus": 0, "num_gpus": 1 if on_gpu else 0, "runtime_env": {"env_vars": actor_env_vars()}}
    pg = get_current_placement_group()
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                          placement_group_bundle_index=0)
    else:  # a CPU replica reserves nothing for it: keep it on the replica's node when there is room
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                        soft=True)
    return options


@dataclass
class _Accumulated:
    """A request's outputs rebuilt on the replica from the polls' deltas."""

    prompt: str | None
    prompt_token_ids: list[int]
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)

    def apply(self, request_id: str, delta: Delta) -> RequestOutput:
        _, finished, error, metrics, choices = delta
        outputs = []
        for index, text, token_ids, logprobs, finish_reason, stop_reason, cumulative in choices:
            self.texts[index] = self.texts.get(index, "") + text
            self.token_ids.setdefault(index, []).extend(token_ids)
            if logprobs is not None:
                self.logprobs.setdefault(index, []).extend(logprobs)
            outputs.append(CompletionOutput(index, self.texts[index], list(self.token_ids[index]),
                                            list(self.logprobs[index]) if index in self.logprobs else None,
                                            finish_reason, stop_reason, cumulative))
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, outputs, finished, metrics, error)


class RemoteAsyncEngine(OutputStreams):
    """The replica's side of an EngineCore actor, with AsyncLLMEngine's interface."""

    def __init__(self, engine_kwargs: dict, actor_options: dict, output_interval_s: float = 0.0):
        super().__init__()
        from engine.tokenizer import load_tokenizer

        self.core = core_actor_class().options(**actor_options).remote(engine_kwargs, output_interval_s)
        info = ray.get(self.core.info.options(concurrency_group="control").remote(), timeout=START_TIMEOUT_S)
        self.tokenizer = load_tokenizer(info["tokenizer_path"], info["chat_template"])  # the engine's, resolved there
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
        self.max_num_seqs = info["max_num_seqs"]
        self._stats: EngineStats = info["stats"]
        self._acc: dict[str, _Accumulated] = {}
        self._ops: list[tuple] = []  # adds and aborts queued in this turn of the event loop
        self._apply = self.core.apply.options(concurrency_group="control")
        self._poll = self.core.poll.options(concurrency_group="poll")
        self._pump: asyncio.Task | None = None
        self._dead_error: str | None = None
        self._closed = False

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    @dead_error.setter
    def dead_error(self, reason: str | None) -> None:
        self._dead_error = reason

    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        return process_prompt(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len,
                              self.max_num_seqs)

    def get_stats(self) -> EngineStats:
        return self._stats

    def check_health(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)
        if self._pump is not None and self._pump.done() and not self._closed:
            raise EngineDeadError("the replica stopped polling its engine")

    def check_executor(self) -> None:
        """Pings the engine actor and its workers (blocking: call it in a thread); raises if one is gone."""
        ray.get(self.core.check_health.options(concurrency_group="health").remote(), timeout=CALL_TIMEOUT_S)

    async def check_integrity(self) -> None:
        self._ensure_pump()
        self._flush()  # the adds and aborts queued before it go first
        await self.core.check_integrity.options(concurrency_group="control").remote()

    def abort(self, request_id: str) -> None:
        self._acc.pop(request_id, None)
        if not self._closed:
            self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._closed = True
        if self._pump is not None and not self._pump.get_loop().is_closed():
            self._pump.get_loop().call_soon_threadsafe(self._pump.cancel)
        try:
            ray.get(self.core.shutdown.options(concurrency_group="control").remote(), timeout=CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - it may be gone already
            logger.warning("engine actor did not shut down cleanly", exc_info=True)
        ray.kill(self.core)

    def _add(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams) -> None:
        self._ensure_pump()
        self._acc[request_id] = _Accumulated(text, token_ids)
        self._send(("add", request_id, text, token_ids, params))

    def _send(self, op: tuple) -> None:
        """Queues an add or abort; the queue goes to the engine actor, in order, at the end of this turn of the
        event loop. (An actor call costs the replica's event loop about a millisecond: one per request made
        admitting a burst of requests the replica's bottleneck.)"""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop (shutdown paths): send at once
            self._apply.remote([op])
            return
        self._ops.append(op)
        if len(self._ops) == 1:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        ops, self._ops = self._ops, []
        if ops and not self._closed:
            self._apply.remote(ops)

    def _ensure_pump(self) -> None:
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._pump_outputs())

    async def _pump_outputs(self) -> None:
        while not self._closed:
            try:
                deltas, stats, dead = await self._poll.remote(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the actor is gone: nothing more will come
                if self._closed:
                    return
                logger.error("engine actor failed: %s", e)
                self._dead_error = f"the engine process failed: {type(e).__name__}: {e}"
                self._fail_all(EngineDeadError(self._dead_error))
                return
            self._stats = stats
            outputs = []
            for delta in deltas:
                request_id = delta[0]
                acc = self._acc.get(request_id)
                if acc is None:
                    continue  # aborted here already
                outputs.append(acc.apply(request_id, delta))
                if delta[1]:
                    del self._acc[request_id]
            self._put_all(outputs)
            if dead is not None:
                self._dead_error = dead
                self._fail_all(EngineDeadError(dead))
                return
