"""`AsyncLLMEngine`: the engine behind an asyncio server.

Steps run in one background thread (they block on the model); the event loop only queues additions and aborts,
which the step thread applies between steps, so the scheduler is only ever touched by one thread. Each request's
outputs reach its `generate()` caller through an asyncio queue.

    generate() ──add──► pending ops ──► [step thread: apply ops, engine.step()] ──outputs──► per-request queues

The two halves are separate so that the step thread can also live in another process: `EngineLoop` is the step
thread (it hands each step's outputs to a callback), `OutputStreams` the per-request queues behind `generate()`.
`AsyncLLMEngine` joins them in one process; `cluster.engine_core` puts an `EngineLoop` in a Ray actor of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from engine.llm_engine import EngineStats, LLMEngine, Prompt
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a worker died or a step crashed); the replica must be restarted."""


class EngineLoop:
    """The step thread: applies queued operations between steps and hands every step's outputs to `on_outputs`
    (called from the step thread). When a step or a worker fails for good, every request gets an error output
    and `on_dead(error)` is called."""

    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 on_dead: Callable[[str], None] | None = None):
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self._ops: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: str | None = None
        self.stats = engine.get_stats()

    def start(self) -> None:
        if self._thread is None:
            # The step thread shares this process's GIL with an event loop (in a replica) or with the threads that
            # answer polls (in the engine actor). Python hands the GIL to a waiting thread only every switch
            # interval, 5 ms by default: the step thread, back from waiting on the device, would wait that long
            # to launch the next step while the GPU idles.
            sys.setswitchinterval(float(os.environ.get("PAGODA_GIL_SWITCH_INTERVAL_S", SWITCH_INTERVAL_S)))
            self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
            self._thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        """Runs `op` in the step thread before the next step."""
        with self._lock:
            self._ops.append(op)
        self._wakeup.set()

    def add(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
            on_error: Callable[[Exception], None]) -> None:
        def add():
            try:
                self.engine.add_processed(request_id, text, token_ids, params)
            except Exception as e:  # reaches the caller instead of the log
                on_error(e)

        self.submit(add)

    def abort(self, request_id: str) -> None:
        self.submit(lambda: self.engine.abort_request(request_id))

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("engine loop is not running")

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.engine.shutdown()

    def _run(self) -> None:
        _configure_step_thread(self.engine.config.parallel.device)
        report = _StepReport(self.engine)
        try:
            while not self._stopping:
                self._apply_ops()
                if not self.engine.has_unfinished_requests():
                    self.stats = self.engine.get_stats()
                    if not self._wakeup.wait(timeout=1.0):
                        self._check_executor()  # idle: a worker that died now is noticed within a second
                    self._wakeup.clear()
                    continue
                report.before_step()
                outputs = self.engine.step()
                self.stats = self.engine.get_stats()
                if outputs:
                    self.on_outputs(outputs)
                self._check_executor()
                report.after_step(self.stats)
        except BaseException as e:  # the loop is the replica's heart: report, fail everyone, stop
            logger.exception("engine loop died")
            self.dead_error = f"{type(e).__name__}: {e}"
            self.on_outputs(self.engine.fail_all(self.dead_error))
            if self.on_dead is not None:
                self.on_dead(self.dead_error)

    def _check_executor(self) -> None:
        try:
            self.engine.executor.check_health()
        except Exception as e:
            raise EngineDeadError(f"worker failed: {e}") from e

    def _apply_ops(self) -> None:
        with self._lock:
            ops, self._ops = self._ops, []
        for op in ops:
            try:
                op()
            except Exception:
                logger.exception("engine op failed")


class OutputStreams:
    """The asyncio side: one queue per request, filled with its cumulative outputs, drained by `generate()`.

    Subclasses say how a request reaches the engine (`_add`, `abort`) and call `_put_all` / `_fail_all` on the
    event loop as outputs or failures come."""

    def __init__(self):
        self._queues: dict[str, asyncio.Queue] = {}
        self._final_only: set[str] = set()  # requests that want only their finished output
        self._wakers: dict[str, asyncio.Future] = {}  # requests waiting out their interval: woken by the end
        self._loop: asyncio.AbstractEventLoop | None = None

    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        raise NotImplementedError

    def check_health(self) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _add(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                       final_only: bool = False, interval_s: float = 0.0) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs as tokens arrive; the last has finished=True (with final_only, only that one:
        the caller is not woken at every step). With interval_s, outputs come at most once per interval (each
        carrying all tokens since the last), except that the final one comes at once. Invalid input raises
        ValueError before anything is queued. Cancelling the iteration (a client that went away) aborts the
        request."""
        self.check_health()
        text, token_ids = self.process_prompt(prompt, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if final_only:
            self._final_only.add(request_id)
        self._add(request_id, text, token_ids, params)
        finished, last_yield = False, -float("inf")
        try:
            while not finished:
                item = _newest(queue, await queue.get())
                wait = last_yield + interval_s - loop.time()
                if wait > 0 and not _is_last(item):  # let tokens gather; the end wakes us early
                    waker = self._wakers[request_id] = loop.create_future()
                    try:
                        await asyncio.wait([waker], timeout=wait)
                    finally:
                        self._wakers.pop(request_id, None)
                    item = _newest(queue, item)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                last_yield = loop.time()
        finally:
            self._queues.pop(request_id, None)
            self._final_only.discard(request_id)
            if not finished:
                self.abort(request_id)

    def _error_to(self, request_id: str) -> Callable[[Exception], None]:
        """A thread-safe callback that fails one request's generate() with the given exception."""
        loop = self._loop

        def fail(e: Exception) -> None:
            if loop is not None:
                loop.call_soon_threadsafe(self._put_error, request_id, e)

        return fail

    def _put_error(self, request_id: str, error: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)
            self._wake(request_id)

    def _put_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None and (out.finished or out.request_id not in self._final_only):
                queue.put_nowait(out)
                if out.finished:
                    self._wake(out.request_id)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, queue in self._queues.items():
            queue.put_nowait(error)
            self._wake(request_id)

    def _wake(self, request_id: str) -> None:
        waker = self._wakers.get(request_id)
        if waker is not None and not waker.done():
            waker.set_result(None)


def _newest(queue: asyncio.Queue, item):
    """Outputs are cumulative: a consumer that fell behind skips to the newest (never past the last or an error)."""
    while not queue.empty() and not _is_last(item):
        item = queue.get_nowait()
    return item


def _is_last(item) -> bool:
    return isinstance(item, BaseException) or item.finished


class AsyncLLMEngine(OutputStreams):
    """The engine and its step thread in this process."""

    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self.loop = EngineLoop(engine, self._deliver, self._on_dead)

    @classmethod
    def from_args(cls, **kwargs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_args(**kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def dead_error(self) -> str | None:
        return self.loop.dead_error

    @dead_error.setter
    def dead_error(self, reason: str | None) -> None:
        self.loop.dead_error = reason

    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        return self.engine.process_prompt(prompt, params)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def get_stats(self) -> EngineStats:
        """The latest stats, as of the last step (safe to read from the event loop)."""
        return self.loop.stats

    def check_health(self) -> None:
        self.loop.check_health()

    def check_executor(self) -> None:
        """Pings the workers (blocking: call it in a thread); raises if one is gone."""
        self.engine.executor.check_health()

    async def check_integrity(self) -> None:
        """Runs the block manager's invariants in the step thread (between steps)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def run():
            try:
                self.engine.check_integrity()
                loop.call_soon_threadsafe(done.set_result, None)
            except BaseException as e:  # reported to the caller
                loop.call_soon_threadsafe(done.set_exception, e)

        self.loop.start()
        self.loop.submit(run)
        await done

    def shutdown(self) -> None:
        self.loop.shutdown()

    def _add(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams) -> None:
        self.loop.start()
        self.loop.add(request_id, text, token_ids, params, self._error_to(request_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._put_all, outputs)

    def _on_dead(self, error: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(error))


class _StepReport:
    """Diagnostics of the step loop, on stderr. PAGODA_LOG_STEPS_S=T: a line every T seconds of work (steps, time
    per step, the part of it spent waiting for the device, the batch); a loop whose device wait is near zero is
    host-bound. PAGODA_PROFILE_STEPS=FIRST:COUNT: a cProfile of those steps of the loop (where the host's time
    goes), printed once they are done."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.interval_s = _float_env("PAGODA_LOG_STEPS_S")
        self.last, self.last_time = replace(engine.timing), time.monotonic()
        self.profile_steps = _step_range(os.environ.get("PAGODA_PROFILE_STEPS", ""))
        self.profiler = None
        self.num_steps = 0

    def before_step(self) -> None:
        if self.num_steps == self.profile_steps.start and self.profile_steps:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def after_step(self, stats: EngineStats) -> None:
        self.num_steps += 1
        if self.profiler is not None and self.num_steps == self.profile_steps.stop:
            import pstats

            self.profiler.disable()
            print(f"pagoda engine: profile of steps {self.profile_steps.start}-{self.profile_steps.stop - 1}, "
                  f"running {stats.num_running}", file=sys.stderr)
            pstats.Stats(self.profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
            self.profiler = None
        if self.interval_s <= 0 or time.monotonic() - self.last_time < self.interval_s:
            return
        t = self.engine.timing.since(self.last)
        print(f"pagoda engine: {t['steps']} steps, {t['ms_per_step']:.2f} ms/step, device wait "
              f"{t['device_wait_ms_per_step']:.2f} ms/step, running {stats.num_running}, waiting {stats.num_waiting}",
              file=sys.stderr, flush=True)
        self.last, self.last_time = replace(self.engine.timing), time.monotonic()


def _float_env(name: str) -> float:
    try:
        return float(os.environ.get(name, "0"))
    except ValueError:
        logger.warning("%s=%r is not a number: ignored", name, os.environ[name])
        return 0.0


def _step_range(spec: str) -> range:
    """"FIRST:COUNT" (or "FIRST": one step) as a range of step numbers; empty when unset or malformed."""
    if not spec:
        return range(0)
    first, _, count = spec.partition(":")
    try:
        return range(int(first), int(first) + int(count or 1))
    except ValueError:
        logger.warning("PAGODA_PROFILE_STEPS=%r is not FIRST:COUNT: ignored", spec)
        return range(0)


def _configure_step_thread(device: str) -> None:
    """On CPU, torch's multi-threaded ops started from a thread other than the main one pay for a new OpenMP team
    on every op (a 64x128 matmul: 60 us instead of 11 us on the CI machine): the step thread runs its ops on
    PAGODA_TORCH_THREADS threads (default 1)."""
    from engine.config import resolve_device

    if resolve_device(device) == "cpu":
        import torch

        torch.set_num_threads(int(os.environ.get("PAGODA_TORCH_THREADS", "1")))
