"""Structured outputs in the benchmarks: the fixed schema of `--structured json-schema`, its rows' grammar figures,
and the host cost of the grammars alone (`python -m benchmarks.structured`: no model, any tokenizer).

The schema is an array of at least 100 records, so no output completes it within a benchmark's max_tokens: every
constrained request generates exactly as many tokens as an unconstrained one (a fair tokens/s comparison), through
every kind of state (keys, bounded strings, enums, numbers, booleans).

    python -m benchmarks.structured --tokenizer DIR --vocab-size 128256 --rows 1 64 256 [--output-json host.json]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from benchmarks.common import print_table, write_json
from engine.grammar import BATCH_FILL_MIN_ROWS, StructuredOutputManager

BENCH_SCHEMA = {
    "type": "array", "minItems": 100,
    "items": {"type": "object",
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "name": {"type": "string", "maxLength": 24},
                             "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "urgent", "later"]},
                                      "maxItems": 4},
                             "score": {"type": "number", "minimum": 0, "maximum": 100},
                             "done": {"type": "boolean"}},
              "required": ["id", "name", "tags", "score", "done"]}}
STRUCTURED_CHOICES = ("json-schema",)


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    """`--structured`: a constrained run beside each plain one, on the same engine and requests. (`--tokenizer
    smollm2`, an engine flag, takes SmolLM2's 49152-token tokenizer: the mask cost grows with the tokenizer.)"""
    parser.add_argument("--structured", choices=STRUCTURED_CHOICES, default=None,
                        help="also run every request under this constraint (the same engine, the same requests)")


def structured_variants(args) -> list[str | None]:
    return [None] + ([args.structured] if getattr(args, "structured", None) else [])


def tokenizer_dir(name: str) -> str:
    """A tokenizer directory; 'smollm2': the built-in model's (its 49152-token tokenizer), prepared once."""
    if name != "smollm2":
        return name
    from checkpoints.builtin import default_model_path

    return default_model_path()


def constraint(name: str | None):
    """The StructuredOutputsParams of a `--structured` choice (None: unconstrained)."""
    if name is None:
        return None
    from engine.structured_outputs import StructuredOutputsParams

    if name != "json-schema":
        raise ValueError(f"structured must be one of {STRUCTURED_CHOICES}, got {name!r}")
    return StructuredOutputsParams(json=BENCH_SCHEMA)


def grammar_figures(stats, since=None) -> dict:
    """Compile time per schema and mask time per step, from the engine's GrammarStats (since an earlier copy)."""
    fills = stats.num_fills - (since.num_fills if since else 0)
    rows = stats.num_fill_rows - (since.num_fill_rows if since else 0)
    fill_s = stats.fill_s - (since.fill_s if since else 0.0)
    return {"tokenizer_info_ms": 1e3 * stats.tokenizer_info_s, "grammar_compiles": stats.num_compiles,
            "grammar_compile_ms_max": 1e3 * stats.max_compile_s,
            "mask_steps": fills, "mask_rows_per_step": rows / max(fills, 1),
            "mask_ms_per_step": 1e3 * fill_s / max(fills, 1)}


# ---- the host cost alone ---------------------------------------------------------------------------------------
def measure_host(tokenizer, vocab_size: int, num_rows: int, steps: int, fill_threads: int | None = None,
                 seed: int = 0) -> dict:
    """num_rows sequences of BENCH_SCHEMA at different states; each step fills their bitmask (as the engine does
    once per step) and accepts one allowed token per row, picked at random (any weights)."""
    from dataclasses import replace

    from engine.request import Request
    from engine.sampling_params import SamplingParams

    manager = StructuredOutputManager(tokenizer, vocab_size, [tokenizer.eos_token_id or 0])
    if fill_threads is not None:
        manager.num_fill_threads = fill_threads
    params = SamplingParams(structured_outputs=constraint("json-schema"), max_tokens=None)
    params.all_stop_token_ids = ()
    manager.add([Request("cold", [0], params, 1 << 30)])
    manager.wait_for_compile(timeout_s=600)
    manager.poll()
    reqs = {}
    for i in range(num_rows):
        req = Request(f"r{i}", [0], replace(params), 1 << 30)
        manager.add([req])
        reqs[req.req_id] = req
    manager.wait_for_compile(timeout_s=600)
    manager.poll()
    rng = random.Random(seed)
    for req in reqs.values():  # spread the rows over the schema's states
        _advance(manager, req, reqs, rng, steps=rng.randint(0, 60))
    req_ids = list(reqs)
    fill_s = accept_s = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        bitmask = manager.fill_bitmask(req_ids, reqs).bitmask
        t1 = time.perf_counter()
        tokens = [_pick(row, vocab_size, rng) for row in bitmask]
        t2 = time.perf_counter()
        for req, token in zip(reqs.values(), tokens):
            assert req.grammar.accept(token)
        accept_s += time.perf_counter() - t2
        fill_s += t1 - t0
    manager.shutdown()
    return {"rows": num_rows, "vocab_size": vocab_size, "tokenizer_tokens": len(tokenizer),
            "fill_threads": manager.num_fill_threads if num_rows >= BATCH_FILL_MIN_ROWS else 1,
            "tokenizer_info_ms": 1e3 * manager.stats.tokenizer_info_s,
            "compile_ms": 1e3 * manager.stats.max_compile_s, "mask_ms_per_step": 1e3 * fill_s / steps,
            "accept_ms_per_step": 1e3 * accept_s / steps}


def _advance(manager, req, reqs, rng, steps: int) -> None:
    for _ in range(steps):
        row = manager.fill_bitmask([req.req_id], reqs).bitmask[0]
        assert req.grammar.accept(_pick(row, manager.vocab_size, rng))


def _pick(row: np.ndarray, vocab_size: int, rng: random.Random) -> int:
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])
    return int(allowed[rng.randrange(len(allowed))])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory or 'smollm2' (default: the tiny model's)")
    parser.add_argument("--vocab-size", type=int, default=128256, help="the model's (Llama 3: 128256)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--fill-threads", type=int, nargs="+", default=[1, 0],
                        help="xgrammar threads for the bitmask (0: the engine's default, half the cores up to 8)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    from engine.tokenizer import load_tokenizer

    if args.tokenizer is None:
        from checkpoints.tiny import default_tiny_model_path

        args.tokenizer = default_tiny_model_path()
    tokenizer = load_tokenizer(tokenizer_dir(args.tokenizer))
    vocab_size = max(args.vocab_size, len(tokenizer))
    rows = [measure_host(tokenizer, vocab_size, n, args.steps, threads or None)
            for n in args.rows for threads in dict.fromkeys(args.fill_threads)]
    print_table(rows, ["rows", "vocab_size", "tokenizer_tokens", "fill_threads", "tokenizer_info_ms", "compile_ms",
                       "mask_ms_per_step", "accept_ms_per_step"])
    result = {"benchmark": "structured-host", "tokenizer": args.tokenizer, "results": rows}
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
