"""Where an engine's start-up goes: seconds per phase, recorded where each phase runs, reported in `EngineInfo`.

    replica placed ─► the engine actor's process starts ─► process (Ray's worker boot, the actor's imports)
      ─► tokenizer ─► imports (torch, kernels) ─► device ─► weights ─► kv_scales (FP8 KV only) ─► kv_profile
      ─► kv_alloc ─► cuda_graphs ─► warm_up ─► ready (scheduler, block manager) ─► first request

`benchmarks/cold_start.py` (`pagoda bench cold-start`) adds the replica's side: placed -> first token.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StartupTimes:
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds, in the order they ran
    process_started_at: float | None = None  # time.time() when this process started (None: not known)

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

    def total_s(self) -> float:
        return sum(self.phases.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())


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
