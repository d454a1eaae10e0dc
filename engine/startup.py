"""Where an engine's start-up goes: seconds per phase, recorded where each phase runs, reported in `EngineInfo`.

    replica placed ─► the engine actor's process starts ─► process (Ray's worker boot, the actor's imports)
      ─► imports (torch, kernels) ─► device ─► weights ─► kv_scales (FP8 KV only) ─► kv_profile ─► kv_alloc
      ─► cuda_graphs ─► warm_up ─► tokenizer_wait ─► ready (scheduler, block manager) ─► first request
                 └─ tokenizer (its own thread, from the end of imports on) ─┘
      (a GPU engine's tokenizer loads in a child process, started before the imports; the thread waits for it)

`phases` is the critical path: its phases ran one after another, so they add up to the start-up's time.
`overlapped` holds the phases that ran on a thread of their own beside them (`BackgroundPhase`); what the critical
path spent waiting for one is its phase `<name>_wait`. `benchmarks/cold_start.py` (`pagoda bench cold-start`) adds
the replica's side: placed -> first token.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Overlap:
    """A phase that ran beside the critical path: its time on its thread, and how much of it that thread spent on
    a CPU. Python code holds the GIL, so a `cpu_s` near `wall_s` hid only the time the critical path spent off it
    (waiting for the device, a compiler, the disk)."""

    wall_s: float
    cpu_s: float


@dataclass
class StartupTimes:
    phases: dict[str, float] = field(default_factory=dict)  # the critical path: phase -> seconds, in order
    process_started_at: float | None = None  # time.time() when this process started (None: not known)
    overlapped: dict[str, Overlap] = field(default_factory=dict)  # phases on threads of their own, beside `phases`

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def merge(self, other: StartupTimes) -> None:
        for name, seconds in other.phases.items():
            self.add(name, seconds)
        self.overlapped.update(other.overlapped)

    def total_s(self) -> float:
        """The critical path's seconds (the overlapped phases ran within them)."""
        return sum(self.phases.values())

    def describe(self) -> str:
        text = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        beside = ", ".join(f"{name} {o.wall_s:.1f} s ({o.cpu_s:.1f} s CPU)" for name, o in self.overlapped.items())
        return f"{text}; beside them: {beside}" if beside else text


class BackgroundPhase(Generic[T]):
    """A start-up phase on a thread of its own while the caller goes on with the next ones (the tokenizer's load
    beside the model's). `join()` waits for it in the caller's thread and returns its result or raises its error
    there, as if it had run inline; it records the phase in `overlapped` and the wait as `<name>_wait`.

    A failure is logged at once, so that it is seen while the caller's phases still run (a model can take minutes
    to load), and raised by `join()`."""

    def __init__(self, name: str, fn: Callable[[], T]):
        self.name = name
        self._fn = fn
        self._result: T  # set by _run unless it records an error
        self._error: BaseException | None = None
        self._overlap = Overlap(0.0, 0.0)
        self._thread = threading.Thread(target=self._run, name=f"pagoda-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            self._result = self._fn()
        except BaseException as e:  # noqa: BLE001 - raised by join(), in the caller's thread
            self._error = e
            logger.error("start-up phase %r failed (raised when the start-up joins it): %s: %s", self.name,
                         type(e).__name__, e)
        self._overlap = Overlap(time.perf_counter() - start, time.thread_time() - cpu_start)

    def join(self, startup: StartupTimes) -> T:
        with startup.phase(f"{self.name}_wait"):
            self._thread.join()
        startup.overlapped[self.name] = self._overlap
        if self._error is not None:
            raise self._error
        return self._result


def process_started_at() -> float | None:
    """When this process started, as time.time() (Linux: /proc); None where that is not known."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    age_s = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age_s
