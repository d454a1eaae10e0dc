"""`pagoda bench {latency,throughput,serve,sampler,quality,cold-start,multi-turn,kv-tier-cost,spec-decode}` (also
`python -m benchmarks ...`); the Triton kernels have a script of their own, `python -m benchmarks.kernels`."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "latency": "decode time per token at several batch sizes and prompt lengths",
    "throughput": "offline LLM.generate over synthetic requests (--compare hf: transformers side by side)",
    "serve": "an async HTTP client against a running OpenAI-compatible server",
    "sampler": "the sampler alone: device and host time of one step for each sampling setting",
    "quality": "a quantized model (--quantization, --kv-cache-dtype) against transformers, teacher-forced",
    "cold-start": "one replica from placed to its first token, per phase (engine actor, weights, CUDA graphs...)",
    "multi-turn": "multi-turn conversations re-sending their histories: TTFT with the host KV tier off and on",
    "kv-tier-cost": "the host KV tier's copy rate and the model's prefill rate: the cost model's settings",
    "spec-decode": "speculative decoding on a copy-heavy chat workload: acceptance, tokens a step, speed-up",
}
KERNELS = "python -m benchmarks.kernels: Triton kernels against torch and the H200's ceilings"


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    """One subcommand a benchmark, each with its own flags (importing every benchmark module)."""
    parser = argparse.ArgumentParser(prog=prog, description=f"Pagoda's benchmarks (also {KERNELS}).")
    sub = parser.add_subparsers(dest="benchmark", required=True, title="benchmarks")
    for name, help_text in BENCHMARKS.items():
        bench = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(_module(name)).add_args(bench)
        bench.set_defaults(func=run_bench)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    importlib.import_module(_module(args.benchmark)).main(args)
    return 0


def _module(name: str) -> str:
    return f"benchmarks.{name.replace('-', '_')}"


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    args = build_parser(prog).parse_args(argv)
    return args.func(args)
