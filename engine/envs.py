"""Every environment variable Pagoda reads, in one place: name, type, default and meaning.

Values are read when asked for (`envs.get("PAGODA_STEP_TIMEOUT_S")`), never at import time, so a test or a
launcher that sets one before starting an engine is obeyed. A malformed value is a warning and the default, not a
crash: a typo in a tuning knob must not take a replica down. This module imports only the standard library, so
every package (kernels/ too) may read its variables through it. The README lists them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: type  # int, float, str or bool
    default: object
    help: str


_VARS = [
    EnvVar("PAGODA_CACHE", str, "", "where built-in models and preset configs are prepared (default ~/.cache/pagoda)"),
    EnvVar("PAGODA_API_KEY", str, "", "`pagoda serve`: the API key when --api-key is not given"),
    EnvVar("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", bool, False,
           "`pagoda serve` / the Serve app: 1 turns on POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
           "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; the app arg allow_runtime_lora_updating too)"),
    EnvVar("PAGODA_TORCH_THREADS", int, 1, "CPU only: torch threads of the step thread and of each worker actor"),
    EnvVar("PAGODA_GIL_SWITCH_INTERVAL_S", float, 0.0005,
           "the engine process's GIL switch interval (the step thread waits no longer than this for the GIL)"),
    EnvVar("PAGODA_LOG_STEPS_S", float, 0.0, "> 0: a line on stderr every that many seconds of steps (time, batch)"),
    EnvVar("PAGODA_PROFILE_STEPS", str, "", "FIRST:COUNT: a cProfile of those steps of the engine loop, on stderr"),
    EnvVar("PAGODA_ENGINE_STALL_S", float, 120.0,
           "a replica whose engine has requests but made no step for this long (since its last step or since work "
           "came to it idle) fails its health check; the app arg engine_stall_timeout_s overrides it"),
    EnvVar("PAGODA_PLACEMENT_TIMEOUT_S", float, 300.0, "waiting for a placement group (an autoscaler may add a node)"),
    EnvVar("PAGODA_WORKER_INIT_TIMEOUT_S", float, 1200.0, "loading and profiling one rank's shard"),
    EnvVar("PAGODA_STEP_TIMEOUT_S", float, 300.0, "one step on the worker actors (first steps may compile kernels)"),
    EnvVar("PAGODA_DISABLE_COMPILED_GRAPH", bool, False, "1: one actor call per rank per step, no Ray compiled graph"),
    EnvVar("PAGODA_SYMM_MEM", bool, True, "0: NCCL for every all-reduce (no symmetric-memory one-shot kernel)"),
    EnvVar("PAGODA_PDL", bool, True,
           "0: no programmatic dependent launch of the Triton kernels on Hopper (each kernel waits for the last)"),
    EnvVar("PAGODA_KERNELS", str, "",
           "`ref`: the torch reference of every kernel, also on a GPU, and no CUDA graphs (debugging)"),
    EnvVar("PAGODA_SPEC_RUN_AHEAD", str, "device",
           "n-gram speculation: 0 pipelines verify steps (drafts from the driver, each verify step read back "
           "first); 1 launches each ahead of the one in flight (device drafts); `auto` runs whichever measures "
           "faster while serving (engine/spec_decode.py RunAheadChoice); `device`, the default, launches ahead when "
           "the device's batch-1 decode step, timed at start-up, takes 1.5 ms or more (a device-bound model: "
           "Llama-3-8B's verify step cost 1.04 plain steps ahead, 1.12 pipelined), else pipelines (a host-bound "
           "one: SmolLM2's copy workload ran 1.4-2.1x pipelined, 0.5-1.0x ahead on an H200)"),
    EnvVar("PAGODA_GRAMMAR_THREADS", int, 0,
           "threads that fill a step's grammar bitmask from 16 constrained rows on (0: half the cores, at most 8)"),
    EnvVar("PAGODA_GRAMMAR_COMPILE_TIMEOUT_S", float, 60.0,
           "a constrained request whose grammar has not compiled this long after it came (queue and compilation) "
           "fails; its compilation is cancelled if it has not started"),
]
VARS = {v.name: v for v in _VARS}


def get(name: str):
    """The variable's value, typed; its default when unset, empty or malformed."""
    var = VARS[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return var.default
    try:
        if var.kind is bool:
            if raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return var.kind(raw)
    except ValueError:
        logger.warning("%s=%r is not a valid %s: using %r", name, raw, var.kind.__name__, var.default)
        return var.default


def cache_dir() -> str:
    """$PAGODA_CACHE, or ~/.cache/pagoda."""
    return get("PAGODA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagoda")


def forwarded() -> dict[str, str]:
    """The PAGODA_* variables set in this process, to pass on to the actors it starts."""
    return {name: os.environ[name] for name in VARS if os.environ.get(name)}
