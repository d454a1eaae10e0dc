"""What the benchmarks share: synthetic requests, percentiles, JSON output."""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The synthetic workload's flags, under vLLM's bench names too (--num-prompts, --input-len, ...)."""
    parser.add_argument("--num-prompts", "--num-requests", dest="num_requests", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[128, 1024],
                        help="prompt lengths drawn uniformly from this range")
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                        help="every prompt this long (instead of --input-len-range)")
    parser.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=256)


def input_len_range(args: argparse.Namespace) -> tuple[int, int]:
    return (args.input_len, args.input_len) if args.input_len else tuple(args.input_len_range)


def synthetic_prompts(num: int, input_len_range: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids (skipping the first 1000 ids, where special tokens usually live), uniform lengths."""
    rng = np.random.default_rng(seed)
    low, high = input_len_range
    lengths = rng.integers(low, high + 1, size=num)
    first = 1000 if vocab_size > 2000 else 5
    return [rng.integers(first, vocab_size, size=int(n)).tolist() for n in lengths]


# Named sampling settings for the benchmarks' sweeps. "seed": the settings of the issue's seed guide, together.
SAMPLING_SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "top_k": {"temperature": 1.0, "top_k": 50},
    "repetition": {"temperature": 1.0, "repetition_penalty": 1.1},
    "seed": {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1},
}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99))}


def free_device_memory() -> None:
    """What an engine that was shut down held on the GPU, given back before the next engine starts."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or 'x86'})"


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)
