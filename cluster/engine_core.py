"""The engine in a process of its own: an `EngineCore` (engine/core.py) as a Ray actor beside its Serve replica,
reached through `RayConnection`, AsyncLLMEngine's connection for it.

    replica process (Serve, asyncio)                 EngineCore actor (own process, own GIL)
    AsyncLLMEngine ── apply([AddRequest, ...]) ──►    step thread: scheduler, detokenizer, model (or workers)
         ▲       ◄── poll() -> PollResult ──────────  outbox of RequestDeltas
                 ◄── check_health() (a thread of its own)

In one process the step thread and Serve's streaming share the GIL: with a few hundred streams the step thread
waits for it and the GPU idles. The actor belongs to the replica (it dies with it) and sits where
cluster/placement.py puts it: in the replica's bundle (holding the GPU on tensor_parallel_size 1), or on its node.
"""

from __future__ import annotations

import logging

import ray

from cluster.executors import pick_executor
from engine.async_engine import CoreConnection
from engine.config import EngineConfig
from engine.core import AbortRequest, AddRequest, EngineCore, EngineInfo, PollResult

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading a large model
CALL_TIMEOUT_S = 60.0


def core_actor_class():
    """Control calls in order on one thread; polls and health pings on threads of their own."""
    return ray.remote(concurrency_groups={"control": 1, "poll": 1, "health": 1})(EngineCore)


class RayConnection(CoreConnection):
    def __init__(self, config: EngineConfig, actor_options: dict):
        self.actor = core_actor_class().options(**actor_options).remote(config, pick_executor)
        self._control = lambda method: getattr(self.actor, method).options(concurrency_group="control")

    def start(self) -> EngineInfo:
        return ray.get(self._control("info").remote(), timeout=START_TIMEOUT_S)

    def send(self, messages: list[AddRequest | AbortRequest]) -> None:
        self._control("apply").remote(messages)

    async def poll(self, timeout_s: float) -> PollResult:
        return await self.actor.poll.options(concurrency_group="poll").remote(timeout_s)

    async def check_integrity(self) -> None:
        await self._control("check_integrity").remote()

    def check_health(self) -> None:
        ray.get(self.actor.check_health.options(concurrency_group="health").remote(), timeout=CALL_TIMEOUT_S)

    def fail(self, reason: str) -> None:
        self._control("fail").remote(reason)

    def shutdown(self) -> None:
        try:
            ray.get(self._control("shutdown").remote(), timeout=CALL_TIMEOUT_S)
        except Exception:  # it may be gone already
            logger.warning("engine actor did not shut down cleanly", exc_info=True)
        ray.kill(self.actor)
