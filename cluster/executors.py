"""Which executor runs an engine's steps. The engine imports none (engine/ imports nothing above it): its callers,
the `LLM` facade, the engine actor and the replica, hand `pick_executor` to LLMEngine, EngineCore or
LocalConnection."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor import ExecutorClass


def pick_executor(config: EngineConfig) -> ExecutorClass:
    """The worker in this process for one rank without Ray; a Ray actor group otherwise. Imported here, lazily: an
    engine on one rank never imports Ray, and the import (torch, the kernels) is the start-up's `imports` phase."""
    if config.parallel.tensor_parallel_size == 1 and not config.parallel.use_ray:
        from workers.worker import InProcessExecutor

        return InProcessExecutor
    from cluster.actor_group import RayExecutor

    return RayExecutor
