"""Cold start of one model replica as Serve starts it: from "placed" (the replica's actor is created with its
resources) to its first token, per phase.

    pagoda bench cold-start --preset llama-3-8b [--repeat 2] [--output-json cold.json]

A stand-in replica, an actor with the replica's own Ray options and placement group (cluster/placement.py),
builds `LLMServer` itself, which starts the engine actor where a replica starts it (RayConnection) and loads the
tokenizer while that actor loads the model; then one request runs to its first token. Phases:

    replica_process   the call that creates the replica -> its __init__ runs (scheduling, process, the imports of
                      the deployment's class, which Serve's replica has done before its __init__)
    engine_scheduled  replica __init__ -> the engine actor's process starts (Ray starts a worker for it)
    engine: process, imports, device, weights, kv_profile, kv_alloc, cuda_graphs, warm_up, tokenizer_wait, ready
                      (engine/startup.py, recorded inside the engine actor)
    replica_other     the rest of the replica's start-up (its own tokenizer, once the engine is ready)
    first_token       a 16-token prompt -> its first token

These add up to placed -> first token. Below them, the phases that ran beside them on a thread of their own
(engine.tokenizer, from the end of engine.imports on; `engine.tokenizer_wait` is what the engine waited for it),
with the CPU time of that thread: near its wall time, it hid only what the others spent off the GIL.

A second run (--repeat 2) finds what the first left behind: Triton's kernels compiled on disk (--kernel-cache
fresh starts from an empty cache, as a new pod does), the weights in the page cache.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, replace

from benchmarks.common import device_name, print_table, write_json


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--repeat", type=int, default=1, help="start this many replicas, one after another")
    parser.add_argument("--kernel-cache", default=None,
                        help="TRITON_CACHE_DIR for the cluster this starts ('fresh': a new empty one, as on a new "
                             "pod; run 2 then shows what a cache kept across replicas and restarts saves)")
    parser.add_argument("--output-json", default=None)


class _Replica:
    """Runs where Serve would run the replica; builds LLMServer as Serve does and times its first token."""

    def __init__(self):
        import cluster.server  # noqa: F401 - a Serve replica has imported its deployment's class before __init__

        self.entered = time.time()

    async def start(self, engine_args, placement) -> dict:
        from cluster.protocol import GenerateRequest
        from cluster.server import LLMServer, ServerSettings
        from engine.request_output import RequestDelta
        from engine.sampling_params import SamplingParams

        server = LLMServer.func_or_class(engine_args, ServerSettings("cold-start", placement))
        ready = time.time()
        request = GenerateRequest("cold-start-0", SamplingParams(max_tokens=1, ignore_eos=True),
                                  prompt=list(range(1, 17)), stream=True)
        async for item in server.generate(request):
            if isinstance(item, list) and any(isinstance(d, RequestDelta) and d.num_new_tokens for d in item):
                break
        first_token = time.time()
        startup = server.engine.startup
        result = {"entered": self.entered, "ready": ready, "first_token": first_token,
                  "engine_process_started_at": startup.process_started_at, "engine": dict(startup.phases),
                  "engine_overlapped": {name: asdict(o) for name, o in startup.overlapped.items()}}
        await server.__del__()
        return result


def start_once(engine_args, placement) -> dict:
    """One replica start, timed from the driver's call; returns seconds per phase."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.placement import PLACEMENT_STRATEGY

    options = placement.replica_options()
    actor_options = dict(options["ray_actor_options"])
    pg = None
    if placement.uses_placement_group:  # as Serve does: the replica in bundle 0, its children in the group
        pg = placement_group(options["placement_group_bundles"], strategy=PLACEMENT_STRATEGY)
        ray.get(pg.ready(), timeout=600)
        actor_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
    placed = time.time()
    replica = ray.remote(_Replica).options(**actor_options).remote()
    try:
        r = ray.get(replica.start.remote(engine_args, placement), timeout=1800)
    finally:
        ray.kill(replica)
        if pg is not None:
            remove_placement_group(pg)
    engine_started = r["engine_process_started_at"] or r["entered"]
    engine_s = sum(r["engine"].values())
    phases = {"replica_process": r["entered"] - placed, "engine_scheduled": max(0.0, engine_started - r["entered"]),
              **{f"engine.{k}": v for k, v in r["engine"].items()}}
    phases["replica_other"] = max(0.0, r["ready"] - r["entered"] - phases["engine_scheduled"] - engine_s)
    phases["first_token"] = r["first_token"] - r["ready"]
    return {"placed_to_first_token_s": r["first_token"] - placed, "phases": phases,
            "overlapped": {f"engine.{k}": v for k, v in r["engine_overlapped"].items()}}


def main(args: argparse.Namespace) -> dict:
    from cluster.placement import ReplicaPlacement
    from cluster.ray_utils import ensure_ray_initialized, resolve_cluster_device
    from engine.arg_utils import engine_args

    if args.kernel_cache:  # read by every Ray process when the cluster starts (joining one: its own setting)
        os.environ["TRITON_CACHE_DIR"] = (tempfile.mkdtemp(prefix="pagoda-triton-") if args.kernel_cache == "fresh"
                                          else args.kernel_cache)
    ensure_ray_initialized(num_cpus_needed=args.tensor_parallel_size + 1)
    base = engine_args(args)
    device = resolve_cluster_device(base.device)
    engine = replace(base, device=device)
    placement = ReplicaPlacement(engine.tensor_parallel_size, device, num_cpus=1.0, engine_process=True)
    runs = [start_once(engine, placement) for _ in range(args.repeat)]
    rows = [{"phase": name, **{f"run {i + 1} s": run["phases"].get(name, 0.0) for i, run in enumerate(runs)}}
            for name in runs[0]["phases"]]
    rows.append({"phase": "placed -> first token", **{f"run {i + 1} s": run["placed_to_first_token_s"]
                                                     for i, run in enumerate(runs)}})
    for name in runs[0]["overlapped"]:
        for key, label in (("wall_s", "beside the above"), ("cpu_s", "its CPU time")):
            rows.append({"phase": f"{name}, {label}",
                         **{f"run {i + 1} s": run["overlapped"].get(name, {}).get(key, 0.0)
                            for i, run in enumerate(runs)}})
    print_table(rows, ["phase", *(f"run {i + 1} s" for i in range(len(runs)))])
    result = {"benchmark": "cold-start", "device": device_name(), "model": args.preset or args.model or "tiny",
              "load_format": engine.load_format, "tensor_parallel_size": engine.tensor_parallel_size,
              "enforce_eager": engine.enforce_eager, "kernel_cache": os.environ.get("TRITON_CACHE_DIR"),
              "runs": runs}
    write_json(args.output_json, result)
    return result
