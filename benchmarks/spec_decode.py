"""Speculative decoding on a copy-heavy workload: the same chat requests (repeat a passage, edit code) with and
without `--speculative-config`, one engine after the other, `--repeats` times each; prints the acceptance, the
tokens a speculative step gives, and each engine's output tokens per second (medians), and checks that greedy
outputs are identical.

    pagoda bench spec-decode --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --batch-size 1
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import device_name, free_device_memory, print_table, write_json

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass lantern and a "
           "notebook in which he recorded the weather, the ships that passed, and the colour of the sea. On stormy "
           "nights he stayed awake until dawn, trimming the wick and writing down every flash he saw on the horizon.")
CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
        "def describe(width, height):\n    return f'{width} x {height}: area {area(width, height)}'\n")
REQUESTS = [f"Repeat this passage exactly, word for word:\n\n{PASSAGE}",
            f"Rename the function area to rect_area everywhere and print the whole code:\n\n{CODE}"]


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="requests at once (the copy prompts in turn)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="JSON lines of the speculative engine's timed runs: each step's decision (running "
                             "requests, drafts given, measured acceptance, the cost model's fit and ratio, the "
                             "run-ahead way) and each step time the cost model records")


def _run(llm, messages, params) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    return outs, time.perf_counter() - start


def _decisions(engine) -> dict:
    """Counters of the engine's steps: all of them, those whose decision gave no drafts, those with drafts launched
    ahead of the step in flight (SpecDecoder)."""
    spec = engine.spec
    return {"steps": engine.timing.num_steps, "steps_off": spec.num_steps_off if spec else 0,
            "steps_ahead": spec.num_steps_ahead if spec else 0}


def _trace(spec, out) -> None:
    """Writes to `out` what `spec` (a SpecDecoder) decides and records, a JSON line each (--trace)."""
    import json

    decide, record, period = spec.decide, spec.cost.record, spec.record_verify_period
    k = spec.config.num_speculative_tokens

    def traced_decide(num_running: int) -> int:
        decided = decide(num_running)
        fit = spec.cost.fit()
        ratio = spec.cost.ratio(num_running, num_running * (1 + k), spec.propose_s or 0.0) if num_running else None
        out.write(json.dumps({"t": time.perf_counter(), "decide": decided, "running": num_running,
                              "acceptance": spec.acceptance, "fit": fit, "ratio": ratio, "ahead": spec.run_ahead.ahead,
                              "probe_every": spec.probe_every, "propose_s": spec.propose_s}) + "\n")
        return decided

    def traced_record(num_tokens: int, seconds: float) -> None:
        out.write(json.dumps({"t": time.perf_counter(), "record": num_tokens, "s": seconds}) + "\n")
        record(num_tokens, seconds)

    def traced_period(ahead: bool, seconds: float) -> None:
        out.write(json.dumps({"t": time.perf_counter(), "period": seconds, "ahead": ahead}) + "\n")
        period(ahead, seconds)

    spec.decide, spec.cost.record, spec.record_verify_period = traced_decide, traced_record, traced_period


def main(args: argparse.Namespace) -> None:
    from dataclasses import asdict, replace

    from engine.arg_utils import engine_args
    from engine.sampling_params import SamplingParams
    from pagoda import LLM

    spec_args = engine_args(args)
    if not spec_args.speculative_config:
        raise ValueError("--speculative-config is required (the plain engine is the same flags without it)")
    messages = [[{"role": "user", "content": REQUESTS[i % len(REQUESTS)]}] for i in range(args.batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # One engine at a time (two of a real-sized model need not fit on the GPU together): each warms up, then runs
    # the requests --repeats times.
    times: dict[str, list[float]] = {}
    outputs = {}
    for name, engine_args_ in (("plain", replace(spec_args, speculative_config=None)), ("spec", spec_args)):
        llm = LLM(**asdict(engine_args_))
        _run(llm, messages, params)  # warm-up
        stats = type(llm.engine.scheduler.spec_stats)()
        llm.engine.scheduler.spec_stats = stats
        times[name] = []
        before = _decisions(llm.engine)
        trace = open(args.trace, "w") if args.trace and llm.engine.spec is not None else None
        if trace is not None:
            _trace(llm.engine.spec, trace)
        for _ in range(args.repeats):
            outputs[name], seconds = _run(llm, messages, params)
            times[name].append(seconds)
        decisions = {k: v - before[k] for k, v in _decisions(llm.engine).items()}
        if trace is not None:
            trace.close()
        if llm.engine.spec is not None:  # how the engine ran the speculative runs (the run-ahead choice's state)
            choice = llm.engine.spec.run_ahead
            decisions |= {"run_ahead_setting": choice.pinned, "ahead_at_end": choice.ahead,
                          "switches": choice.num_switches,
                          "period_ms": {str(k): v and round(1e3 * v, 3) for k, v in choice.period.items()}}
        llm.shutdown()
        del llm
        free_device_memory()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs["plain"])
    identical = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outputs["plain"], outputs["spec"]))
    rates = {name: num_tokens / statistics.median(t) for name, t in times.items()}
    row = {"device": device_name(), "batch_size": args.batch_size, "output_tokens": num_tokens,
           "acceptance": round(stats.acceptance_rate, 3),
           "tokens_per_spec_step": round(1 + stats.num_accepted_tokens / max(stats.num_drafts, 1), 2),
           "accepted_per_position": stats.accepted_per_position,
           "plain_tok_s": round(rates["plain"], 1), "spec_tok_s": round(rates["spec"], 1),
           "speedup": round(rates["spec"] / rates["plain"], 2), "identical": identical,
           "plain_s": times["plain"], "spec_s": times["spec"], "spec_engine": decisions}
    print_table([row], ["device", "batch_size", "output_tokens", "acceptance", "tokens_per_spec_step", "plain_tok_s",
                        "spec_tok_s", "speedup", "identical"])
    print(f"accepted by position: {stats.accepted_per_position}")
    print(f"the speculative engine's steps: {decisions}")
    if args.output_json:
        write_json(args.output_json, {"speculative_config": spec_args.speculative_config, "results": [row]})
