"""`AsyncLLMEngine`: the one serving-engine interface, for an asyncio server (a Serve replica).

    generate() ──AddRequest──► sender (one ordered batch per event-loop turn) ──► EngineCore (engine/core.py)
    per-request queue ◄── pump: poll() ──► PollResult(deltas) ◄──────────────────── its outbox

The engine core runs where its `CoreConnection` puts it: `LocalConnection` in this process (its step thread beside
the event loop), or cluster.engine_core's `RayConnection` in a Ray actor of its own (own process, own GIL). Either
way the replica sees the same calls and the same `RequestDelta`s, which it forwards as they are.

Two rules keep one request from hurting the others: the adds and aborts of every request and the poll loop are
sent from a context of their own (never a request's, whose cancellation would cancel a batched call holding other
requests' adds), and a replica whose engine has requests but makes no step for `stall_timeout_s` fails its health
check (a lost message or a hung device is then a replaced replica, not a hang). That clock starts when the engine
last stepped or when work arrived at an idle engine, whichever is later: a replica idle since its start is not
stalled when its first burst comes.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable

from engine import envs
from engine.config import EngineConfig
from engine.core import AbortRequest, AddRequest, EngineCore, EngineInfo, PollResult
from engine.errors import EngineDeadError
from engine.executor import ExecutorPicker
from engine.llm_engine import EngineStats
from engine.lora import LoRARequest
from engine.prompts import Prompt, PromptLimits, process_prompt, prompt_limits
from engine.request_output import RequestDelta
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0  # an idle poll returns after this long (stats stay fresh, a dead core is noticed)


class CoreConnection(ABC):
    """How an AsyncLLMEngine reaches its EngineCore. Every call but `poll` and `check_integrity` is synchronous;
    `send` returns at once and delivers its messages in the order of the calls."""

    @abstractmethod
    def start(self) -> EngineInfo:
        """Waits until the core has loaded the model; its start-up values."""

    @abstractmethod
    def send(self, messages: list[AddRequest | AbortRequest]) -> None:
        """Queues adds and aborts for the core (one way)."""

    @abstractmethod
    async def poll(self, timeout_s: float) -> PollResult:
        """Every delta since the last poll; raises when the core is gone."""

    @abstractmethod
    async def check_integrity(self) -> None:
        """The block manager's invariants, checked between two steps."""

    @abstractmethod
    def check_health(self) -> None:
        """Blocking: raises when the core or one of its workers is dead."""

    @abstractmethod
    def fail(self, reason: str) -> None:
        """Stops the core's loop as a crashed step would (debugging)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the core and releases its devices."""


class LocalConnection(CoreConnection):
    """The core in this process: its step thread shares this process's GIL with the event loop."""

    def __init__(self, config: EngineConfig, pick_executor: ExecutorPicker):
        self.core = EngineCore(config, pick_executor)

    def start(self) -> EngineInfo:
        return self.core.info()

    def send(self, messages: list[AddRequest | AbortRequest]) -> None:
        self.core.apply(messages)

    async def poll(self, timeout_s: float) -> PollResult:
        return await asyncio.to_thread(self.core.poll, timeout_s)

    async def check_integrity(self) -> None:
        await asyncio.to_thread(self.core.check_integrity)

    def check_health(self) -> None:
        self.core.check_health()

    def fail(self, reason: str) -> None:
        self.core.fail(reason)

    def shutdown(self) -> None:
        self.core.shutdown()


class AsyncLLMEngine:
    """Requests in, `RequestDelta` batches out. Build it on the event loop's thread; `generate` runs there."""

    def __init__(self, config: EngineConfig, connection: CoreConnection,
                 stall_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        """stall_timeout_s: None reads $PAGODA_ENGINE_STALL_S (120 s unless set). clock: what the stall check
        measures time with (a test drives its own)."""
        from engine.tokenizer import load_tokenizer

        self.config = config
        self.connection = connection
        self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.chat_template)  # while a core loads
        info = self.connection.start()
        self.startup = info.startup  # where the engine's start-up went (engine/startup.py)
        self.max_model_len = info.max_model_len
        self.vocab_size = config.model.vocab_size
        self.limits: PromptLimits = prompt_limits(self.tokenizer, self.vocab_size, self.max_model_len,
                                                  config.scheduler.max_num_seqs)
        self.stall_timeout_s = stall_timeout_s if stall_timeout_s is not None else envs.get("PAGODA_ENGINE_STALL_S")
        self._clock = clock
        self._stats: EngineStats = info.stats
        self._step_tokens: list[int] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._outgoing: list[AddRequest | AbortRequest] = []
        self._pump: asyncio.Task | None = None
        self._dead_error: str | None = None
        self._closed = False
        self._last_progress = (self._stats.num_steps, clock())  # (steps, when): the stall clock

    # ---- requests ------------------------------------------------------------------------------------------------
    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Validates as the engine would (tokenizing text): (text, token ids), or a ParamError. Blocking."""
        return process_prompt(prompt, params, self.tokenizer, self.limits)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       stream: bool = True, arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[list[RequestDelta]]:
        """Yields the request's deltas, in batches as polls bring them; the last one has finished=True. With
        stream=False that is the only one. Closing the iteration early (a client that went away) aborts it."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        if not self._queues:  # work arrives at an idle engine: the stall clock starts now, not at its last step
            self._last_progress = (self._stats.num_steps, self._clock())
        self._queues[request_id] = queue
        self._send(AddRequest(request_id, prompt_token_ids, params, stream, arrival_time, lora_request))
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = [item for item in items if not isinstance(item, BaseException)]
                if batch:  # deltas that came before a death are the request's own end (its error finish) or not
                    finished = batch[-1].finished
                    yield batch
                if not finished and len(batch) < len(items):
                    raise next(item for item in items if isinstance(item, BaseException))
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._send(AbortRequest(request_id))

    # ---- health and stats ----------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self._stats

    def take_step_tokens(self) -> list[int]:
        tokens, self._step_tokens = self._step_tokens, []
        return tokens

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine is dead, the poll loop stopped, or the engine has requests but
        made no step for stall_timeout_s."""
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)
        if self._pump is not None and self._pump.done() and not self._closed:
            raise EngineDeadError("the replica stopped polling its engine")
        _, since = self._last_progress
        if self._queues and self._clock() - since > self.stall_timeout_s:
            raise EngineDeadError(f"the engine made no step for {self.stall_timeout_s:.0f} s with "
                                  f"{len(self._queues)} requests in flight")

    def check_executor(self) -> None:
        """Pings the engine and its workers (blocking: call it in a thread); raises if one is gone."""
        self.connection.check_health()

    async def check_integrity(self) -> None:
        self._flush()  # the adds and aborts queued before it go first
        await self.connection.check_integrity()

    def fail(self, reason: str) -> None:
        """Debugging: the engine dies as if a step had crashed; its requests fail, the health check fails."""
        self.connection.fail(reason)

    def shutdown(self) -> None:
        self._closed = True
        if self._pump is not None and not self._pump.get_loop().is_closed():
            self._pump.get_loop().call_soon_threadsafe(self._pump.cancel)
        try:
            self.connection.shutdown()
        except Exception:  # it may be gone already
            logger.warning("engine did not shut down cleanly", exc_info=True)

    # ---- plumbing ------------------------------------------------------------------------------------------------
    def _send(self, message: AddRequest | AbortRequest) -> None:
        """Queues a message; the queue goes out, in order, at the end of this turn of the event loop (a call per
        request would make admitting a burst the replica's bottleneck), from a context of its own."""
        if self._closed:
            return
        self._outgoing.append(message)
        if len(self._outgoing) == 1:
            loop = asyncio.get_running_loop()
            loop.call_soon(self._flush, context=contextvars.Context())
            if self._pump is None:
                self._pump = loop.create_task(self._pump_deltas(), context=contextvars.Context())

    def _flush(self) -> None:
        messages, self._outgoing = self._outgoing, []
        if messages and not self._closed:
            self.connection.send(messages)

    async def _pump_deltas(self) -> None:
        while not self._closed:
            try:
                result = await self.connection.poll(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the core is gone: nothing more will come
                if not self._closed:
                    logger.error("engine failed: %s", e)
                    self._die(f"the engine process failed: {type(e).__name__}: {e}")
                return
            self._stats = result.stats
            self._step_tokens.extend(result.step_tokens)
            if result.stats.num_steps != self._last_progress[0] or not self._queues:
                self._last_progress = (result.stats.num_steps, self._clock())
            for delta in result.deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:  # else: aborted here already
                    queue.put_nowait(delta)
            if result.dead_error is not None:
                self._die(result.dead_error)
                return

    def _die(self, reason: str) -> None:
        self._dead_error = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
