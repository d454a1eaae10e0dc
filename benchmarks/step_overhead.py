"""Per-step control overhead of tensor parallelism: from `schedule()` returning to every rank starting its forward.

Two ways to hand a step's `SchedulerOutput` to the ranks, both through `cluster.actor_group.StepBroadcast` (the code
the RayExecutor runs):

    calls   one plain actor call per rank (the step passed by value: inlined in each call)
    graph   a Ray Compiled Graph: one serialization, shared-memory channels (the RayExecutor's default)

Probe actors stand in for the workers: `execute_model` notes the time the step reached it and returns a
ModelRunnerOutput of the step's size (rank 0) or None, so this measures the broadcast and the way back, not a
model. `dispatch` is the time until the LAST rank has the step (its forward's first all-reduce waits for that
rank); `round trip` adds the way back to the driver. The clocks are `time.perf_counter` (CLOCK_MONOTONIC: one clock
for every process of the machine). Scenarios: 256 running requests in decode (the common step under load), one
(the channel's own latency), and 8 new 1024-token prompts (a large first message).

    .venv/bin/python benchmarks/step_overhead.py [--tp 1 2] [--steps 300] [--rounds 3] [--output-json overhead.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import ray

from cluster.actor_group import StepBroadcast
from engine.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams


class ProbeWorker:
    """Answers a step like a worker rank would, without a model."""

    def __init__(self, rank: int):
        self.rank = rank

    def execute_model(self, sched: SchedulerOutput):
        arrived = time.perf_counter()
        if self.rank != 0:
            return arrived, None
        req_ids = list(sched.num_scheduled_tokens)
        return arrived, ModelRunnerOutput(req_ids, [7] * len(req_ids), [None] * len(req_ids))


def decode_step(num_reqs: int = 256, block_size: int = 16, step: int = 0) -> SchedulerOutput:
    """`num_reqs` cached requests, one decode token each; the ones crossing a block boundary get a new block."""
    cached, scheduled = [], {}
    for i in range(num_reqs):
        req_id = f"cmpl-{i:08x}{'0' * 24}"  # the length of an OpenAI-style request id
        num_computed = 300 + i + step
        new_blocks = [1000 + i] if num_computed % block_size == 0 else []
        cached.append(CachedRequestData(req_id, new_blocks, num_computed))
        scheduled[req_id] = 1
    return SchedulerOutput(cached_reqs=cached, num_scheduled_tokens=scheduled)


def prefill_step(num_reqs: int = 8, prompt_len: int = 1024, block_size: int = 16) -> SchedulerOutput:
    new, scheduled = [], {}
    num_blocks = -(-prompt_len // block_size)
    for i in range(num_reqs):
        req_id = f"cmpl-new-{i:04x}"
        new.append(NewRequestData(req_id, list(range(100, 100 + prompt_len)), [], SamplingParams(max_tokens=128),
                                  list(range(i * num_blocks, (i + 1) * num_blocks)), 0))
        scheduled[req_id] = prompt_len
    return SchedulerOutput(new_reqs=new, num_scheduled_tokens=scheduled)


def measure(broadcast: StepBroadcast, sched: SchedulerOutput, steps: int, warmup: int) -> tuple[list, list]:
    """(dispatch, round trip) in seconds, one pair per measured step."""
    dispatch, round_trip = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        results = broadcast.run(sched, timeout_s=60)
        end = time.perf_counter()
        if i >= warmup:
            dispatch.append(max(arrived for arrived, _ in results) - start)
            round_trip.append(end - start)
    return dispatch, round_trip


def summarize(dispatch: list[float], round_trip: list[float]) -> dict:
    return {"dispatch_p50_ms": _ms(statistics.median(dispatch)), "dispatch_p90_ms": _ms(_p90(dispatch)),
            "round_trip_p50_ms": _ms(statistics.median(round_trip)), "round_trip_p90_ms": _ms(_p90(round_trip))}


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def run(tp_sizes: list[int], steps: int, warmup: int, rounds: int) -> list[dict]:
    """Modes alternate over `rounds` rounds (steps split among them), so that a busy machine's drift hits both."""
    scenarios = {"decode-1": decode_step(1), "decode-256": decode_step(), "prefill-8x1024": prefill_step()}
    rows = []
    for tp in tp_sizes:
        probe = ray.remote(num_cpus=0)(ProbeWorker)
        actors = [probe.remote(rank) for rank in range(tp)]
        ray.get([a.execute_model.remote(SchedulerOutput()) for a in actors])  # started
        samples = {(mode, name): ([], []) for mode in ("calls", "graph") for name in scenarios}
        for _ in range(rounds):
            for mode in ("calls", "graph"):
                broadcast = StepBroadcast(actors, use_compiled_graph=mode == "graph")
                assert broadcast.is_compiled == (mode == "graph"), "the compiled graph did not compile"
                for name, sched in scenarios.items():
                    dispatch, round_trip = measure(broadcast, sched, -(-steps // rounds), warmup)
                    samples[mode, name][0].extend(dispatch)
                    samples[mode, name][1].extend(round_trip)
                broadcast.teardown()
        for (mode, name), (dispatch, round_trip) in samples.items():
            rows.append({"tp": tp, "mode": mode, "scenario": name,
                         "payload_bytes": len(pickle.dumps(scenarios[name])), **summarize(dispatch, round_trip)})
        for actor in actors:
            ray.kill(actor)
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'tp':>2}  {'mode':<5}  {'scenario':<15} {'payload':>9}  {'dispatch p50':>12} {'p90':>7}  " \
             f"{'round trip p50':>14} {'p90':>7}   (ms)"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['tp']:>2}  {r['mode']:<5}  {r['scenario']:<15} {r['payload_bytes']:>8}B  "
              f"{r['dispatch_p50_ms']:>12.3f} {r['dispatch_p90_ms']:>7.3f}  "
              f"{r['round_trip_p50_ms']:>14.3f} {r['round_trip_p90_ms']:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (ranks)")
    parser.add_argument("--steps", type=int, default=300, help="measured steps per mode and scenario")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured steps at the start of each round")
    parser.add_argument("--rounds", type=int, default=3, help="times each mode is set up and measured, alternating")
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: a local one)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=max(args.tp) + 1, include_dashboard=False, log_to_driver=False)
    try:
        rows = run(args.tp, args.steps, args.warmup, args.rounds)
    finally:
        ray.shutdown()
    print_table(rows)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "step_overhead", "steps": args.steps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
