"""`EngineCore`: the engine and its step thread, behind a message interface that works in-process or across a
process boundary (a Ray actor: cluster/engine_core.py).

    client (a Serve replica's event loop)                 EngineCore
    apply([AddRequest | AbortRequest, ...])  ─ in order ─►  ops queue ─► step thread: apply ops, engine.step()
    poll(timeout) ◄── PollResult(deltas, stats) ◄──────────  outbox: every RequestDelta since the last poll

The step thread is the only one that touches the scheduler. Adds and aborts are queued and applied between steps;
every delta the engine produces (engine/request_output.py) goes into the outbox unchanged, and a poll takes them
all at once, so a poll's size is what the steps since the last one produced, not the outputs' length.
"""

from __future__ import annotations

import cProfile
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine import envs
from engine.config import EngineConfig, resolve_device
from engine.errors import EngineDeadError
from engine.executor import ExecutorPicker
from engine.llm_engine import EngineStats, LLMEngine
from engine.lora import LoRARequest
from engine.request_output import RequestDelta, RequestError
from engine.sampling_params import SamplingParams
from engine.startup import StartupTimes, process_started_at

logger = logging.getLogger(__name__)

MAX_EARLY_ABORTS = 10_000
DEVICE_STATS_PERIOD_S = 2.0


# ---- the messages (plain, picklable) --------------------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = True  # False: one delta, at the end, with the whole output
    arrival_time: float | None = None  # time.time() when the request reached the server
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class PollResult:
    deltas: list[RequestDelta]
    stats: EngineStats
    step_tokens: list[int]  # tokens of each step since the last poll
    dead_error: str | None = None  # set once the loop died: nothing more will come


@dataclass
class EngineInfo:
    """What a client needs besides the config it was made from: values the engine settled at start-up."""

    max_model_len: int
    num_kv_blocks: int
    stats: EngineStats
    startup: StartupTimes | None = None  # where this engine's start-up went (engine/startup.py)


class EngineCore:
    """Control calls (`apply`, `check_integrity`, `info`) may come from one thread, polls from another; both only
    queue work for the step thread or read what it published."""

    def __init__(self, config: EngineConfig, pick_executor: ExecutorPicker):
        """`pick_executor`: the caller's (cluster.executors.pick_executor), as LLMEngine takes it."""
        started_at, entered = process_started_at(), time.time()
        self.startup = StartupTimes(process_started_at=started_at)
        if started_at is not None:  # the process's start to here: Ray's worker boot, the actor class's imports
            self.startup.add("process", max(0.0, entered - started_at))
        self.engine = LLMEngine(config, pick_executor)
        self.startup.merge(self.engine.startup)
        self._cond = threading.Condition()
        self._outbox: list[RequestDelta] = []
        self._ids_lock = threading.Lock()  # guards the two below
        self._known: set[str] = set()  # added, not yet finished or aborted
        self._aborted_first: OrderedDict[str, None] = OrderedDict()  # aborts that came before their add
        self.loop = EngineLoop(self.engine, self._publish)
        self.loop.start()
        self.startup.add("ready", max(0.0, time.time() - entered - self.startup.total_s()
                                      + self.startup.phases.get("process", 0.0)))

    def info(self) -> EngineInfo:
        return EngineInfo(self.engine.max_model_len, self.engine.block_manager.num_blocks, self.loop.stats,
                          self.startup)

    def apply(self, messages: list[AddRequest | AbortRequest]) -> None:
        """Adds and aborts, in order. An add whose abort came first is dropped (its client is gone already)."""
        for message in messages:
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                self._abort(message.request_id)
            else:
                raise TypeError(f"unknown engine message {type(message).__name__}")

    def _add(self, add: AddRequest) -> None:
        with self._ids_lock:
            if add.request_id in self._aborted_first:
                del self._aborted_first[add.request_id]
                return
            self._known.add(add.request_id)

        def run():
            try:
                self.engine.add_processed(add.request_id, add.prompt_token_ids, add.params, add.stream,
                                          add.arrival_time, add.lora_request)
            except Exception as e:  # noqa: BLE001 - an invalid request fails alone; the client gets the error as its last delta
                self._publish([RequestDelta(add.request_id, finished=True, error=RequestError.from_exception(e))])

        self.loop.submit(run)

    def _abort(self, request_id: str) -> None:
        with self._ids_lock:
            if request_id not in self._known:  # not added yet, or finished already (then this is harmless)
                self._aborted_first[request_id] = None
                while len(self._aborted_first) > MAX_EARLY_ABORTS:
                    self._aborted_first.popitem(last=False)
                return
        self.loop.submit(lambda: self._publish(self.engine.abort_request(request_id)))

    def poll(self, timeout_s: float) -> PollResult:
        """Every delta since the last poll (waiting up to timeout_s for one), the latest stats, the loop's fatal
        error if it died."""
        with self._cond:
            if not self._outbox and self.loop.dead_error is None:
                self._cond.wait(timeout_s)
            deltas, self._outbox = self._outbox, []
        with self._ids_lock:
            for delta in deltas:
                if delta.finished:
                    self._known.discard(delta.request_id)
        return PollResult(deltas, self.loop.stats, self.engine.take_step_tokens(), self.loop.dead_error)

    def check_integrity(self, timeout_s: float = 60.0) -> None:
        """The block manager's invariants, between two steps; raises what they raise."""
        self.loop.call(self.engine.check_integrity, timeout_s)

    def check_health(self) -> None:
        self.loop.check_health()
        self.engine.executor.check_health()

    def fail(self, reason: str) -> None:
        """Debugging: the engine dies as if a step had crashed."""
        self.loop.fail(reason)

    def shutdown(self) -> None:
        self.loop.shutdown()
        with self._cond:
            self._cond.notify_all()

    def _publish(self, deltas: list[RequestDelta]) -> None:
        if deltas:
            with self._cond:
                self._outbox.extend(deltas)
                self._cond.notify_all()


class EngineLoop:
    """The step thread: applies queued operations between steps and hands every step's deltas to `publish`
    (called from the step thread). When a step or a worker fails for good, every request gets an error delta and
    `dead_error` is set."""

    def __init__(self, engine: LLMEngine, publish: Callable[[list[RequestDelta]], None]):
        self.engine = engine
        self.publish = publish
        self._ops: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: str | None = None
        self.stats = engine.get_stats()
        self._device_stats = (0, 0.0, 0.0)  # used bytes, utilization, when read

    def start(self) -> None:
        if self._thread is None:
            # The step thread shares this process's GIL with the threads that answer polls. Python hands the GIL
            # to a waiting thread only every switch interval, 5 ms by default: the step thread, back from waiting
            # on the device, would wait that long to launch the next step while the GPU idles.
            sys.setswitchinterval(envs.get("PAGODA_GIL_SWITCH_INTERVAL_S"))
            self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
            self._thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        """Runs `op` in the step thread before the next step."""
        with self._lock:
            self._ops.append(op)
        self._wakeup.set()

    def call(self, fn: Callable[[], object], timeout_s: float):
        """Runs `fn` in the step thread between two steps and returns its result (or raises what it raised)."""
        done, result = threading.Event(), []

        def run():
            try:
                result.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                result.append((False, e))
            done.set()

        self.submit(run)
        if not done.wait(timeout_s):
            raise TimeoutError("the engine loop did not answer in time")
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("engine loop is not running")

    def fail(self, reason: str) -> None:
        """Stops the loop as a crashed step would (debugging: /debug/fail_engine)."""
        def crash():
            raise EngineDeadError(reason)

        self.submit(crash)

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
                    self._refresh_stats()
                    if not self._wakeup.wait(timeout=1.0):
                        self._check_executor()  # idle: a worker that died now is noticed within a second
                    self._wakeup.clear()
                    continue
                report.before_step()
                self.publish(self.engine.step())
                self._refresh_stats()
                self._check_executor()
                report.after_step(self.stats)
        except BaseException as e:  # the loop is the replica's heart: report, fail everyone, stop
            logger.exception("engine loop died")
            self.dead_error = f"{type(e).__name__}: {e}"
            self.publish(self.engine.fail_all(self.dead_error))

    def _refresh_stats(self) -> None:
        used, utilization, read_at = self._device_stats
        if time.monotonic() - read_at > DEVICE_STATS_PERIOD_S:
            used, utilization = self.engine.executor.device_stats()
            self._device_stats = (used, utilization, time.monotonic())
        self.stats = replace(self.engine.get_stats(), device_memory_used_bytes=used, device_utilization=utilization)

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
            except EngineDeadError:
                raise
            except Exception:
                logger.exception("engine op failed")


class _StepReport:
    """Diagnostics of the step loop, on stderr. PAGODA_LOG_STEPS_S=T: a line every T seconds of work (steps, time
    per step, the part of it spent waiting for the device, the batch); a loop whose device wait is near zero is
    host-bound. PAGODA_PROFILE_STEPS=FIRST:COUNT: a cProfile of those steps of the loop (where the host's time
    goes), printed once they are done."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.interval_s = envs.get("PAGODA_LOG_STEPS_S")
        self.last, self.last_time = replace(engine.timing), time.monotonic()
        self.profile_steps = _step_range(envs.get("PAGODA_PROFILE_STEPS"))
        self.profiler: cProfile.Profile | None = None
        self.num_steps = 0

    def before_step(self) -> None:
        if self.num_steps == self.profile_steps.start and self.profile_steps:
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
    if resolve_device(device) == "cpu":
        import torch

        torch.set_num_threads(envs.get("PAGODA_TORCH_THREADS"))

