"""`AsyncLLMEngine`: the engine behind an asyncio server.

Steps run in one background thread (they block on the model); the event loop only queues additions and aborts,
which the step thread applies between steps, so the scheduler is only ever touched by one thread. Each request's
outputs reach its `generate()` caller through an asyncio queue.

    generate() ──add──► pending ops ──► [step thread: apply ops, engine.step()] ──outputs──► per-request queues
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable

from engine.llm_engine import EngineStats, LLMEngine, Prompt
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a worker died or a step crashed); the replica must be restarted."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._final_only: set[str] = set()  # requests that want only their finished output
        self._ops: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: str | None = None
        self._stats = engine.get_stats()

    @classmethod
    def from_args(cls, **kwargs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_args(**kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- public API ----------------------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                       final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs as tokens arrive; the last has finished=True (with final_only, only that one:
        the caller is not woken at every step). Invalid input raises ValueError before anything is queued.
        Cancelling the iteration (a client that went away) aborts the request."""
        self.check_health()
        text, token_ids = self.engine.process_prompt(prompt, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if final_only:
            self._final_only.add(request_id)
        loop = asyncio.get_running_loop()

        def add():
            try:
                self.engine.add_processed(request_id, text, token_ids, params)
            except Exception as e:  # reaches the caller instead of the log
                loop.call_soon_threadsafe(queue.put_nowait, e)

        self._submit(add)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                while not queue.empty() and not isinstance(item, BaseException) and not item.finished:
                    item = queue.get_nowait()  # outputs are cumulative: a slow consumer skips to the newest
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._final_only.discard(request_id)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort_request(request_id))

    def get_stats(self) -> EngineStats:
        """The latest stats, as of the last step (safe to read from the event loop)."""
        return self._stats

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("engine loop is not running")

    async def check_integrity(self) -> None:
        """Runs the block manager's invariants in the step thread (between steps)."""
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def run():
            try:
                self.engine.check_integrity()
                loop.call_soon_threadsafe(done.set_result, None)
            except BaseException as e:  # reported to the caller
                loop.call_soon_threadsafe(done.set_exception, e)

        self._ensure_loop()
        self._submit(run)
        await done

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.engine.shutdown()

    # ---- the step thread -----------------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
            self._thread.start()

    def _submit(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._ops.append(op)
        self._wakeup.set()

    def _run(self) -> None:
        _configure_step_thread(self.engine.config.parallel.device)
        try:
            while not self._stopping:
                self._apply_ops()
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.get_stats()
                    if not self._wakeup.wait(timeout=1.0):
                        self._check_executor()  # idle: a worker that died now is noticed within a second
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.get_stats()
                self._deliver(outputs)
                self._check_executor()
        except BaseException as e:  # the loop is the replica's heart: report, fail everyone, stop
            logger.exception("engine loop died")
            self.dead_error = f"{type(e).__name__}: {e}"
            self._deliver(self.engine.fail_all(self.dead_error))
            self._fail_queues(EngineDeadError(self.dead_error))

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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._put_all, outputs)

    def _put_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None and (out.finished or out.request_id not in self._final_only):
                queue.put_nowait(out)

    def _fail_queues(self, error: BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: [q.put_nowait(error) for q in self._queues.values()])


def _configure_step_thread(device: str) -> None:
    """On CPU, torch's multi-threaded ops started from a thread other than the main one pay for a new OpenMP team
    on every op (a 64x128 matmul: 60 us instead of 11 us on the CI machine): the step thread runs its ops on
    PAGODA_TORCH_THREADS threads (default 1)."""
    import os

    from engine.config import resolve_device

    if resolve_device(device) == "cpu":
        import torch

        torch.set_num_threads(int(os.environ.get("PAGODA_TORCH_THREADS", "1")))
