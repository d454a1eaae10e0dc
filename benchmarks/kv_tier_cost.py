"""What copying a prefix back from the host KV tier costs against computing it again, on this machine and model: the
numbers behind the host tier's cost model (engine/onload_cost.py: `--onload-gb-per-s`, `--onload-latency-s`,
`--prefill-tokens-per-s`).

    pagoda bench kv-tier-cost --preset llama-3-8b --prefix-lens 1024 2048 4096

1. Copies: the worker's own host pool (workers/kv_pool.py HostKVPool, the copy path the steps use) moves n blocks
   host -> device (and device -> host) for each --copy-blocks n, synchronized; a line through the medians gives the
   fixed cost of a step's copies and the rate.
2. Prefixes, end to end through the engine, for each --prefix-lens L (a prompt of L tokens, one output token): TTFT
   computed (a prompt seen nowhere), copied back (the same prompt once more, its blocks forgotten by the device and
   found on the host) and computed again (the same, with the cost model's threshold past it).
3. The rates the cost model takes, the threshold they give for this model's blocks, and the flags that set them.
4. For the cross-replica fetch (docs/architecture.md, not built): the host copies a fetch on one node makes at least
   (gather the holder's host blocks, one copy where the object store would hold them, scatter into the asker's host
   tier), timed on the largest --copy-blocks, against the rate a fetch must reach to beat prefill (the KV bytes of a
   token x the prefill rate). Ray's object store adds its own costs on top (benchmarks/cross_replica_fetch.py).

One rank (--tensor-parallel-size 1): the copies are timed inside this process's worker.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import device_name, print_table, write_json
from checkpoints.presets import model_or_preset


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[1024, 2048, 4096],
                        help="prompt lengths measured end to end")
    parser.add_argument("--copy-blocks", type=int, nargs="+", default=[1, 4, 16, 64, 256],
                        help="blocks per timed copy")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each measurement (medians are reported)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> dict:
    from cluster.executors import pick_executor
    from engine.arg_utils import engine_args
    from engine.llm_engine import LLMEngine

    if args.tensor_parallel_size != 1:
        raise ValueError("--tensor-parallel-size: kv-tier-cost times one rank's copies in this process; run it with 1 "
                         "(the ranks of a group copy their shares at once, so one rank's rate is the group's)")
    model_dir, load_format = model_or_preset(args.model, args.preset)
    longest = max(args.prefix_lens)
    config = engine_args(args, model=model_dir, load_format=load_format, swap_space=args.swap_space or 8.0,
                         max_num_batched_tokens=max(args.max_num_batched_tokens, longest)).create_engine_config()
    engine = LLMEngine(config, pick_executor)
    try:
        copies = measure_copies(engine, args.copy_blocks, args.repeats)
        prefixes = measure_prefixes(engine, args.prefix_lens, args.repeats, args.workload_seed)
        engine.check_integrity()
    finally:
        engine.shutdown()
    result = {"benchmark": "kv-tier-cost", "device": device_name(),
              "model": args.preset or args.model or "smollm2-135m-instruct", "block_size": config.cache.block_size,
              "block_bytes_per_rank": copies["block_bytes"], "copies": copies["rows"], "prefixes": prefixes,
              **recommend(copies, prefixes, config.cache.block_size)}
    print_table(copies["rows"], ["blocks", "onload_ms", "offload_ms", "onload_gb_per_s"])
    print_table(prefixes, ["prefix_len", "computed_ms", "copied_back_ms", "computed_again_ms", "onloaded_blocks"])
    print(f"onload: {result['onload_gb_per_s']:.1f} GB/s after {1e6 * result['onload_latency_s']:.0f} us; prefill "
          f"{result['prefill_tokens_per_s']:,.0f} tok/s -> min_onload_blocks {result['min_onload_blocks']} "
          f"(blocks of {config.cache.block_size} tokens, {copies['block_bytes']:,} bytes a rank)")
    print(f"flags: {result['flags']}")
    print(f"cross-replica fetch: beats prefill above {result['fetch_break_even_gb_per_s']:.2f} GB/s end to end; this "
          f"host's copies alone move {result['fetch_copies_gb_per_s']:.2f} GB/s (the object store adds to them)")
    write_json(args.output_json, result)
    return result


def measure_copies(engine, counts: list[int], repeats: int) -> dict:
    """Times the worker's host pool moving n blocks each way (medians of `repeats`, after one untimed run)."""
    worker = engine.executor.worker
    pool, sync = worker.runner.host_pool, _synchronizer(worker.device)
    limit = min(engine.block_manager.num_blocks, pool.num_blocks)
    rows = []
    for n in sorted({min(c, limit) for c in counts}):
        pairs = [(i, i) for i in range(n)]  # (device, host): before any request, the blocks hold nothing of value
        # offloads first: the host blocks then hold the device's zeros, not uninitialized memory, when copied back
        offload_s = _median_time(lambda pairs=pairs: (pool.offload(pairs), pool.wait_for_offloads()), sync, repeats)
        onload_s = _median_time(lambda pairs=pairs: pool.onload(pairs), sync, repeats)
        rows.append({"blocks": n, "onload_ms": 1e3 * onload_s, "offload_ms": 1e3 * offload_s,
                     "onload_gb_per_s": n * worker.block_bytes / onload_s / 1e9})
    n = rows[-1]["blocks"]
    fetch_s = _median_time(lambda: _fetch_copies(pool.buffer, n), lambda: None, repeats)
    return {"block_bytes": worker.block_bytes, "rows": rows,
            "fetch_copies_gb_per_s": n * worker.block_bytes / fetch_s / 1e9}


def _fetch_copies(buffer, num_blocks: int) -> None:
    """A same-node fetch's host copies: gather blocks 0..n-1 of one host pool, copy them once more (the object
    store's), scatter them into the other half of a pool (here the same one)."""
    import torch

    ids = torch.arange(num_blocks)
    gathered = buffer[ids]  # [blocks, layers, K and V of a block]: the host pool is block-major
    buffer[ids.flip(0)] = gathered.clone()


def measure_prefixes(engine, lengths: list[int], repeats: int, seed: int) -> list[dict]:
    """TTFT of a prompt computed, copied back from the host, and computed again (medians of `repeats` prompts)."""
    from engine.onload_cost import NEVER_ONLOAD

    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    bm = engine.block_manager
    threshold_before, rows = bm.min_onload_blocks, []
    for length in lengths:
        _ttft(engine, rng.integers(vocab // 4, vocab, length).tolist())  # warm-up: this shape's first run
        times: dict[str, list[float]] = {"computed": [], "copied_back": [], "computed_again": []}
        onloaded = 0
        for _ in range(repeats):
            prompt = rng.integers(vocab // 4, vocab, length).tolist()
            times["computed"].append(_ttft(engine, prompt))
            for name, threshold in (("copied_back", 1), ("computed_again", NEVER_ONLOAD)):
                bm.evict_device_cache()
                bm.min_onload_blocks, before = threshold, bm.num_onloaded_blocks
                times[name].append(_ttft(engine, prompt))
                if name == "copied_back":
                    onloaded = bm.num_onloaded_blocks - before
        rows.append({"prefix_len": length, "onloaded_blocks": onloaded,
                     **{f"{name}_ms": 1e3 * float(np.median(values)) for name, values in times.items()}})
    bm.min_onload_blocks = threshold_before
    return rows


def recommend(copies: dict, prefixes: list[dict], block_size: int) -> dict:
    """The cost model's rates from the measurements, and the threshold they give for this model's blocks."""
    from engine.onload_cost import NEVER_ONLOAD, OnloadCost

    blocks = np.array([r["blocks"] for r in copies["rows"]], dtype=np.float64)
    seconds = np.array([r["onload_ms"] / 1e3 for r in copies["rows"]])
    slope, intercept = np.polyfit(blocks, seconds, 1) if len(blocks) > 1 else (seconds[0] / blocks[0], 0.0)
    slope = max(float(slope), 1e-12)
    onload_bytes_per_s, latency_s = copies["block_bytes"] / slope, max(float(intercept), 0.0)
    prefill = sum(r["prefix_len"] for r in prefixes) / (sum(r["computed_ms"] for r in prefixes) / 1e3)
    threshold = OnloadCost(onload_bytes_per_s, latency_s, prefill).min_onload_blocks(block_size,
                                                                                       copies["block_bytes"])
    flags = (f"--onload-gb-per-s {onload_bytes_per_s / 1e9:.3g} --onload-latency-s {latency_s:.3g} "
             f"--prefill-tokens-per-s {prefill:.4g}")
    return {"onload_gb_per_s": onload_bytes_per_s / 1e9, "onload_latency_s": latency_s,
            "prefill_tokens_per_s": prefill,
            "min_onload_blocks": "never" if threshold == NEVER_ONLOAD else threshold, "flags": flags,
            "fetch_copies_gb_per_s": copies["fetch_copies_gb_per_s"],
            "fetch_break_even_gb_per_s": copies["block_bytes"] / block_size * prefill / 1e9}


def _ttft(engine, prompt: list[int]) -> float:
    """Seconds from adding a one-token request to its token (the engine idle before and after)."""
    from engine.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1,
                                                                          ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        deltas = engine.step()
        if first is None and any(seq.token_ids for d in deltas for seq in d.seqs):
            first = time.perf_counter() - start
    assert first is not None, "the request produced no token"
    engine.step()  # the step that writes its blocks to the host (the engine runs one for offloads alone)
    while engine.has_unfinished_requests():
        engine.step()
    return first


def _median_time(fn, sync, repeats: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _synchronizer(device):
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
