"""`pagoda bench {latency,throughput,serve,sampler,kernels,quality,cold-start}` (also `python -m benchmarks ...`)."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "latency": "decode time per token at several batch sizes and prompt lengths",
    "throughput": "offline LLM.generate over synthetic requests (--compare hf: transformers side by side)",
    "serve": "an async HTTP client against a running OpenAI-compatible server",
    "sampler": "the sampler alone: device and host time of one step for each sampling setting",
    "kernels": "Triton kernels against torch and the H200's ceilings",
    "quality": "a quantized model (--quantization, --kv-cache-dtype) against transformers, teacher-forced",
    "cold-start": "one replica from placed to its first token, per phase (engine actor, weights, CUDA graphs...)",
}


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, help_text in BENCHMARKS.items():
        if name == "kernels":
            continue  # its own script: python -m benchmarks.kernels
        parser = bench_sub.add_parser(name, help=help_text)
        importlib.import_module(_module(name)).add_args(parser)
        parser.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    importlib.import_module(_module(args.benchmark)).main(args)
    return 0


def _module(name: str) -> str:
    return f"benchmarks.{name.replace('-', '_')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(argv or [])] if argv is not None else None)
    return args.func(args)
