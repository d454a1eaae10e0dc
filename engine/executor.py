"""The executor interface: what the engine needs from whatever runs the model (in-process or a Ray actor group)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.config import EngineConfig
from engine.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """The executor failed a step. `is_fatal` when it can run no more steps (a worker died)."""

    def __init__(self, message: str, is_fatal: bool = False):
        super().__init__(message)
        self.is_fatal = is_fatal


class Executor(ABC):
    """Runs steps on every rank. After construction the model is loaded and the KV pool allocated."""

    num_kv_blocks: int
    supports_overlap: bool = False  # execute_model_async returns before the step's tokens are on the host
    # execute_model_async may leave a step's constrained rows unsampled until the driver supplies their grammar
    # bitmask (StepHandle.sample); otherwise the bitmask must travel in the SchedulerOutput.
    supports_deferred_sampling: bool = False

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step on every rank and returns rank 0's output. Raises ExecutorError on failure."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "StepHandle":
        """Launches a step; `.result()` waits for it. Executors that cannot overlap run it right away."""
        return StepHandle(self.execute_model(scheduler_output))

    def check_health(self) -> None:
        """Raises ExecutorError when a worker is dead."""

    def device_stats(self) -> tuple[int, float]:
        """(device memory in use, in bytes; utilization, 0..1), summed / averaged over the ranks; (0, 0.0) on CPU."""
        return 0, 0.0

    def describe(self) -> list[dict]:
        """What each rank runs on (device, all-reduce), for benchmarks and logs."""
        return []

    def startup_phases(self) -> dict[str, float]:
        """Seconds per start-up phase of rank 0 (engine/startup.py: device, weights, kv_profile, ...)."""
        return {}

    def shutdown(self) -> None:
        """Releases workers and memory. Idempotent."""


class StepHandle:
    """A step in flight. `result()` returns its ModelRunnerOutput or raises ExecutorError.

    With deferred sampling, `bitmask_req_ids` names the constrained requests whose grammar bitmask the step waits
    for: its forward runs, and it samples once `sample(bitmask)` supplies them."""

    def __init__(self, output: ModelRunnerOutput | None = None, wait=None, bitmask_req_ids: list[str] | None = None,
                 sample=None):
        self._output = output
        self._wait = wait
        self.bitmask_req_ids = bitmask_req_ids or []
        self._sample = sample
        self._error: ExecutorError | None = None

    def sample(self, bitmask: GrammarBitmask) -> None:
        """Supplies the awaited bitmask. A failure is raised by `result()`, as the step's other failures are."""
        self.bitmask_req_ids = []
        try:
            self._sample(bitmask)
        except ExecutorError as e:
            self._error = e

    def result(self) -> ModelRunnerOutput:
        if self._error is not None:
            raise self._error
        if self._output is None:
            self._output = self._wait()
        return self._output


def executor_class(config: EngineConfig) -> type[Executor]:
    """In-process worker for one rank; a Ray actor group otherwise (imported lazily: engine never needs Ray). The
    import (torch, the kernels) is the start-up's `imports` phase."""
    if config.parallel.tensor_parallel_size == 1 and not config.parallel.use_ray:
        from workers.worker import InProcessExecutor

        return InProcessExecutor
    from cluster.actor_group import RayExecutor

    return RayExecutor
