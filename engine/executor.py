"""The executor interface: what the engine needs from whatever runs the model (in-process or a Ray actor group)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.outputs import DraftAsk, GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """The executor failed a step. `is_fatal` when it can run no more steps (a worker died)."""

    def __init__(self, message: str, is_fatal: bool = False):
        super().__init__(message)
        self.is_fatal = is_fatal


class Executor(ABC):
    """Runs steps on every rank. After construction the model is loaded and the KV pool allocated.

    A step is `launch` then `collect`, and between them, with deferred sampling, `sample` (vLLM v1 splits
    `execute_model` and `sample_tokens` the same way):

        handle = launch(step N+1)          the ranks run N+1's forward (after N, in order)
        collect(handle of step N)          N's tokens on the host; the driver advances N's grammars
        awaiting(handle) -> {req: drafts}  N+1's constrained rows wait for their grammar bitmask ...
        sample(handle, bitmask)            ... which the driver now has: N+1 samples
        collect(handle), next time round

    A step whose constrained rows sample carries their bitmask in its SchedulerOutput when the driver knows it at
    launch (synchronous steps); otherwise it awaits `sample`. Collect steps in launch order."""

    num_kv_blocks: int
    num_host_kv_blocks: int = 0  # the host tier's blocks on every rank (CacheConfig.swap_space_gib); 0: none
    kv_block_bytes: int = 0  # one KV block's bytes, all ranks together (what moving a block between tiers moves)
    # rank 0's batch-1 decode step on the device, timed at start-up (its CUDA graph replayed), in seconds; None where
    # not measured (a CPU, no CUDA graphs, no n-gram speculation): what PAGODA_SPEC_RUN_AHEAD's default decides by
    # (engine/spec_decode.py)
    decode_step_s: float | None = None
    supports_overlap: bool = False  # launch returns before the step's tokens are on the host
    # launch may leave a step's constrained rows unsampled until the driver supplies their grammar bitmask (sample);
    # otherwise the bitmask must travel in the SchedulerOutput.
    supports_deferred_sampling: bool = False

    @abstractmethod
    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Starts a step on every rank. Executors that cannot overlap may run it to its end here. Raises
        ExecutorError."""

    def awaiting(self, handle: StepHandle) -> dict[str, list[int]]:
        """The constrained requests whose grammar bitmask the step waits for before it samples (deferred sampling;
        empty otherwise), each with the drafts it verifies: a verify step's, proposed on the workers after the step
        before (what their lookup found), whose masks the bitmask must hold; none for a plain row. May block until
        the ranks reach the step's sampling (a Ray group reads their answer, which for a step with no constrained
        row is its whole output): the engine asks only about a step that has constrained rows, once it has
        collected the step before. Raises ExecutorError."""
        return {}

    def sample(self, handle: StepHandle, bitmask: GrammarBitmask) -> None:
        """Supplies the bitmask of `awaiting(handle)`: the step samples. Raises ExecutorError."""
        raise NotImplementedError(f"{type(self).__name__} does not defer sampling")

    @abstractmethod
    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Waits for the step and returns rank 0's output. Raises ExecutorError."""

    def take_lora_reads(self) -> dict[int, str | None]:
        """The background adapter reads (SchedulerOutput.lora_reads) that every rank has finished since the last
        call: read id -> None (the adapter is in every rank's host memory) or the first failing rank's error. Never
        waits for a read. Raises ExecutorError."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step to its end (a constrained step carries its bitmask)."""
        return self.collect(self.launch(scheduler_output))

    def propose_drafts(self, ask: DraftAsk) -> dict[str, list[int]]:
        """Speculative decoding with a draft model (SpeculativeConfig.method "draft_model"): the draft model on the
        workers proposes up to `ask.max_drafts[r]` tokens for each request r; a request it fails for gets none.
        Raises ExecutorError when the whole ask failed (the engine then steps without drafts)."""
        raise NotImplementedError(f"{type(self).__name__} runs no draft model")

    def check_integrity(self, block_tables: dict[str, list[int]] | None = None) -> None:
        """Asserts the workers' own books are consistent (a draft model's KV blocks) and agree with the driver's:
        each rank's block table of a running request starts with its `block_tables` entry (it may hold more: blocks
        a verify step's rejected drafts gave back, until the next step of it says so). Tests."""

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


@dataclass
class StepHandle:
    """A launched step: `payload` is what its executor keeps of it (opaque to the engine); `error`, a failure of
    `sample` that the engine raises where it collects the step."""

    payload: Any = None
    error: ExecutorError | None = None


ExecutorClass = Callable[[EngineConfig], Executor]  # starts an executor for a config: loads, allocates the KV pool
ExecutorPicker = Callable[[EngineConfig], ExecutorClass]
"""The caller's choice of executor for a config (engine/ imports none: cluster.executors.pick_executor is the one
Pagoda's callers hand it). LLMEngine calls it in the start-up's `imports` phase: it may import torch and the
kernels."""
