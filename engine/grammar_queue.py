"""`CompileQueue`: grammar compilations on threads of their own, so that no request holds the compiler for others.

    submit(fn) ─► pending (first come, first served) ─► running: `num_threads` at a time, each on its own thread
    a compilation that has run for `slow_s` stops counting against those (`max_slow` of them at most): the small
    constraints behind it go on while it runs, instead of waiting for it (two 40,000-value enums once held both
    threads of a pool for a minute)
    cancel(future): a pending compilation never starts. A running one cannot be stopped: xgrammar 0.2.9 has no way
    to interrupt a compilation (it runs in C++, without the GIL); the size limits of engine/structured_outputs.py
    bound it instead.

`dispatch()` starts what may start: on submit, when a compilation ends, and from the engine's poll (a compilation
turns slow without an event of its own). `clock` may be replaced, so that a test moves time by hand.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(eq=False)
class _Job:
    future: Future
    fn: Callable
    args: tuple
    started_at: float = 0.0


class CompileQueue:
    def __init__(self, num_threads: int, max_slow: int, slow_s: float, clock: Callable[[], float] = time.monotonic):
        assert num_threads >= 1 and max_slow >= 0 and slow_s >= 0, (num_threads, max_slow, slow_s)
        self.num_threads = num_threads
        self.max_slow = max_slow
        self.slow_s = slow_s
        self.clock = clock
        self._pending: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._lock = threading.Lock()
        self._is_shut_down = False

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        with self._lock:
            self._pending.append(_Job(future, fn, args))
        self.dispatch()
        return future

    def cancel(self, future: Future) -> bool:
        """Takes a pending compilation out of the queue (True); False if it runs or ran already."""
        with self._lock:
            job = next((job for job in self._pending if job.future is future), None)
            if job is None:
                return False
            self._pending.remove(job)
        future.cancel()
        return True

    def dispatch(self) -> None:
        """Starts pending compilations while a thread is free (slow ones, up to max_slow, leave theirs free)."""
        with self._lock:
            now = self.clock()
            while self._pending and not self._is_shut_down and self._num_busy(now) < self.num_threads:
                job = self._pending.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
                job.started_at = now
                self._running.append(job)
                threading.Thread(target=self._run, args=(job,), name="pagoda-grammar", daemon=True).start()

    def _num_busy(self, now: float) -> int:
        num_slow = sum(now - job.started_at >= self.slow_s for job in self._running)
        return len(self._running) - min(num_slow, self.max_slow)

    def _run(self, job: _Job) -> None:
        result, error = None, None
        try:
            result = job.fn(*job.args)
        except Exception as e:  # noqa: BLE001 - the future carries it to the request that waits
            error = e
        with self._lock:  # its thread is free before anyone can see it done
            self._running.remove(job)
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
        self.dispatch()

    def shutdown(self) -> None:
        """Cancels what is pending; what runs finishes on its own (daemon threads)."""
        with self._lock:
            self._is_shut_down = True
            pending, self._pending = list(self._pending), deque()
        for job in pending:
            job.future.cancel()
