"""Offline throughput: `LLM.generate` over N synthetic requests; `--compare hf` runs transformers' own continuous
batching (`generate_batch`) on the same weights and requests in the same process and prints the ratio.

Sampling: `--temperature --top-p --top-k --repetition-penalty`, or `--sampling-sweep NAME ...`, which runs each named
setting (benchmarks/common.py; `seed`: temperature 0.7, top_p 0.9, top_k 50, repetition_penalty 1.1) on one loaded
engine, one after the other, and prints each one's throughput against the first's. `--structured json-schema` runs
each setting a second time with every request under a fixed JSON schema (benchmarks/structured.py).

    pagoda bench throughput --preset llama-3-8b --compare hf --output-json out.json
    pagoda bench throughput --preset llama-3-8b --no-prefix-caching --sampling-sweep greedy seed
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, replace

from benchmarks.common import (
    SAMPLING_SETTINGS,
    add_workload_args,
    device_name,
    free_device_memory,
    input_len_range,
    print_table,
    synthetic_prompts,
    write_json,
)
from benchmarks.lora_workload import add_lora_bench_args, lora_label, lora_runs, run_adapters, spread
from benchmarks.structured import add_structured_args, constraint, grammar_figures, structured_variants, tokenizer_dir
from checkpoints.presets import model_or_preset


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    add_workload_args(parser)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sampling-sweep", nargs="+", choices=list(SAMPLING_SETTINGS), default=None,
                        help="named sampling settings, each run on the same loaded engine (replaces the flags above)")
    parser.add_argument("--compare", choices=["hf"], default=None)
    parser.add_argument("--max-num-seqs-runs", dest="max_num_seqs_runs", type=int, nargs="+", default=None,
                        help="run the workload once on an engine with each of these decode batch caps (replaces "
                             "--max-num-seqs): which cap a workload wants, in one call")
    add_structured_args(parser)
    add_lora_bench_args(parser)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps of the first setting's run, after --profile-after steps of it "
                             "(benchmarks/step_profile.py StepWindow: GPU busy and idle, kernels by kind)")
    parser.add_argument("--profile-after", type=int, default=100)
    parser.add_argument("--output-json", default=None)


def sampling_settings(args) -> list[tuple[str, dict]]:
    """(name, SamplingParams fields) of each setting to run: the sweep's, or the one the flags give."""
    if args.sampling_sweep:
        return [(name, SAMPLING_SETTINGS[name]) for name in args.sampling_sweep]
    return [("flags", {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                       "repetition_penalty": args.repetition_penalty})]


def engine_runs(args) -> list[dict]:
    """The engine overrides of each run: each LoRA run (benchmarks/lora_workload.py) at each decode batch cap."""
    caps = [{"max_num_seqs": n} for n in args.max_num_seqs_runs] if args.max_num_seqs_runs else [{}]
    return [lora | cap for lora in lora_runs(args) for cap in caps]


def run_pagoda(args, model_dir: str, load_format: str, prompts: list[list[int]], overrides: dict) -> list[dict]:
    """One engine (the flags, with `overrides`); each sampling setting warms up (its kernels compile) and then runs
    the whole workload (over the run's LoRA adapters, if any: benchmarks/lora_workload.py)."""
    from engine.arg_utils import engine_args
    from pagoda import LLM, SamplingParams

    llm = LLM(**asdict(engine_args(args, model=model_dir, load_format=load_format, **overrides)))
    requests = [{"prompt_token_ids": p} for p in prompts]
    loras = spread(run_adapters(overrides, args, llm.engine.config.model.hf_config), len(requests))
    rows = []
    for (name, setting), structured in [(s, c) for s in sampling_settings(args) for c in structured_variants(args)]:
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, structured_outputs=constraint(structured),
                                **setting)
        llm.generate(requests[:4], params, use_tqdm=False, lora_request=loras[:4])  # warm-up
        llm.engine.block_manager.reset_prefix_cache()
        timing, grammar = replace(llm.engine.timing), replace(llm.engine.structured.stats)
        window = None
        if args.profile_steps and not rows:
            from benchmarks.step_profile import StepWindow

            window = StepWindow(llm.engine, args.profile_after, args.profile_steps)
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
        if window is not None:
            window.close()
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        num_blocks = llm.engine.block_manager.num_blocks
        rows.append(_rates("pagoda", len(prompts), sum(map(len, prompts)), output_tokens, elapsed) | {
            "sampling": name, "sampling_params": setting, "structured": structured, "lora": lora_label(overrides, args),
            "max_num_seqs": llm.engine.config.scheduler.max_num_seqs, "num_kv_blocks": num_blocks,
            "kv_tokens": num_blocks * args.block_size, "engine_steps": llm.engine.timing.since(timing)}
            | (grammar_figures(llm.engine.structured.stats, grammar) if structured else {})
            | ({"profile": window.result} if window is not None else {}))
        if window is not None and window.result is not None:
            from benchmarks.step_profile import print_profile

            print_profile(f"steps {args.profile_after}..{args.profile_after + args.profile_steps}", window.result)
    llm.shutdown()
    del llm
    free_device_memory()
    return rows


def run_hf(args, model_dir: str, load_format: str, prompts: list[list[int]]) -> tuple[dict, str]:
    """transformers' continuous batching; with random weights the model is saved first so Pagoda loads the very
    same weights afterwards. Returns the result and the directory holding the weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if load_format == "random":
        config = AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(args.seed)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: seconds
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        weights_dir = tempfile.mkdtemp(prefix="pagoda-bench-")
        model.save_pretrained(weights_dir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            import shutil

            shutil.copy(f"{model_dir}/{name}", f"{weights_dir}/{name}")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        weights_dir = model_dir
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    name, setting = sampling_settings(args)[0]
    temperature = setting["temperature"]
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=temperature > 0,
                           temperature=max(temperature, 1e-5), top_p=setting.get("top_p", 1.0),
                           top_k=setting.get("top_k", 0), repetition_penalty=setting.get("repetition_penalty", 1.0),
                           eos_token_id=None, pad_token_id=0)
    batch_kwargs = {}
    if not torch.cuda.is_available():  # its cache is sized from free memory: on CPU, all of the machine's RAM
        from transformers.generation import ContinuousBatchingConfig

        batch_kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=256)
    model.generate_batch(inputs=prompts[:4], generation_config=gen, **batch_kwargs)  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen, **batch_kwargs)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(r.generated_tokens) for r in results.values())
    del model, results
    free_device_memory()
    return _rates("transformers", len(prompts), sum(map(len, prompts)), output_tokens, elapsed) | {
        "sampling": name}, weights_dir


def _rates(name: str, num: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> dict:
    return {"engine": name, "requests": num, "elapsed_s": elapsed, "requests_per_s": num / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}



def main(args: argparse.Namespace) -> dict:
    import json
    import os

    args.tokenizer = tokenizer_dir(args.tokenizer) if args.tokenizer else None
    model_dir, load_format = model_or_preset(args.model, args.preset, args.load_format)
    if not args.preset:  # a model name as users type it; none: the tiny model (a quick comparison)
        from checkpoints.source import resolve_model

        model_dir = resolve_model(model_dir or "tiny")
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    prompts = synthetic_prompts(args.num_requests, input_len_range(args), vocab_size, args.seed)
    rows = []
    if args.compare == "hf":
        hf, weights_dir = run_hf(args, model_dir, load_format, prompts)
        rows.append(hf)
        model_dir, load_format = weights_dir, "auto"
    pagoda_rows = [row for overrides in engine_runs(args)
                   for row in run_pagoda(args, model_dir, load_format, prompts, overrides)]
    for row in pagoda_rows:
        row["vs_first"] = row["total_tokens_per_s"] / pagoda_rows[0]["total_tokens_per_s"]
    rows.extend(pagoda_rows)
    result = {"benchmark": "throughput", "device": device_name(), "model": args.preset or args.model or "tiny",
              "num_requests": args.num_requests, "input_len_range": list(input_len_range(args)),
              "output_len": args.output_len, "prefix_caching": args.enable_prefix_caching, "results": rows}
    if args.compare == "hf":
        result["speedup_total_tokens"] = rows[1]["total_tokens_per_s"] / rows[0]["total_tokens_per_s"]
    print_table(rows, ["engine", "sampling", "structured", "lora", "max_num_seqs", "requests", "elapsed_s",
                       "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "vs_first"])
    for row in rows[1 if args.compare == "hf" else 0:]:
        steps = row["engine_steps"]
        print(f"pagoda engine, {row['sampling']}{' ' + row['structured'] if row['structured'] else ''}: "
              f"{steps['steps']} steps, {steps['ms_per_step']:.2f} ms/step, of which waiting for the device "
              f"{steps['device_wait_ms_per_step']:.2f} ms")
        if row["structured"]:
            print(f"    tokenizer read {row['tokenizer_info_ms']:.0f} ms, grammar compile "
                  f"{row['grammar_compile_ms_max']:.1f} ms (slowest schema), mask {row['mask_ms_per_step']:.3f} "
                  f"ms/step over {row['mask_rows_per_step']:.0f} rows")
    if args.structured:  # each constrained row right after its plain one
        result["structured_vs_plain_output_tokens"] = [
            constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]
            for plain, constrained in zip(pagoda_rows[::2], pagoda_rows[1::2])]
        print("constrained / plain output tokens/s:",
              ", ".join(f"{r:.3f}" for r in result["structured_vs_plain_output_tokens"]))
    if args.lora_adapters:  # the LoRA engine's rows after the base engine's, setting for setting
        half = len(pagoda_rows) // 2
        result["lora_vs_base_total_tokens"] = [lora["total_tokens_per_s"] / base["total_tokens_per_s"]
                                               for base, lora in zip(pagoda_rows[:half], pagoda_rows[half:])]
        print("LoRA / base total tokens/s:", ", ".join(f"{r:.3f}" for r in result["lora_vs_base_total_tokens"]))
    if "speedup_total_tokens" in result:
        print(f"pagoda / transformers (total tokens/s): {result['speedup_total_tokens']:.1f}x")
    write_json(args.output_json, result)
    return result
