"""Offline throughput: `LLM.generate` over N synthetic requests; `--compare hf` runs transformers' own continuous
batching (`generate_batch`) on the same weights and requests in the same process and prints the ratio.

    pagoda bench throughput --preset llama-3-8b --compare hf --output-json out.json
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from dataclasses import replace

from benchmarks.common import device_name, print_table, synthetic_prompts, write_json
from workers.presets import resolve_model


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[128, 1024])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--compare", choices=["hf"], default=None)
    parser.add_argument("--output-json", default=None)


def run_pagoda(args, model_dir: str, load_format: str, prompts: list[list[int]]) -> dict:
    from engine.arg_utils import engine_kwargs
    from engine import LLM, SamplingParams

    kwargs = {**engine_kwargs(args), "model": model_dir, "load_format": load_format}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    llm.engine.block_manager.reset_prefix_cache()
    timing = replace(llm.engine.timing)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = llm.engine.timing.since(timing)
    num_blocks = llm.engine.block_manager.num_blocks
    llm.shutdown()
    del llm
    _free_memory()
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return _rates("pagoda", len(prompts), sum(map(len, prompts)), output_tokens, elapsed) | {
        "num_kv_blocks": num_blocks, "kv_tokens": num_blocks * args.block_size, "engine_steps": steps}


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
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=args.temperature > 0,
                           temperature=max(args.temperature, 1e-5), top_p=1.0, top_k=0, eos_token_id=None,
                           pad_token_id=0)
    model.generate_batch(inputs=prompts[:4], generation_config=gen)  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(r.generated_tokens) for r in results.values())
    del model, results
    _free_memory()
    return _rates("transformers", len(prompts), sum(map(len, prompts)), output_tokens, elapsed), weights_dir


def _rates(name: str, num: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> dict:
    return {"engine": name, "requests": num, "elapsed_s": elapsed, "requests_per_s": num / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(args: argparse.Namespace) -> dict:
    import json
    import os

    model_dir, load_format = resolve_model(args.model, args.preset)
    if load_format != "random":  # a model name as users type it; none: the tiny model (a quick comparison)
        from engine.model_source import resolve_model as resolve_name

        model_dir = resolve_name(model_dir or "tiny")
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    prompts = synthetic_prompts(args.num_requests, tuple(args.input_len_range), vocab_size, args.seed)
    rows = []
    if args.compare == "hf":
        hf, weights_dir = run_hf(args, model_dir, load_format, prompts)
        rows.append(hf)
        model_dir, load_format = weights_dir, "auto"
    rows.append(run_pagoda(args, model_dir, load_format, prompts))
    result = {"benchmark": "throughput", "device": device_name(), "model": args.preset or args.model or "tiny",
              "num_requests": args.num_requests, "input_len_range": args.input_len_range,
              "output_len": args.output_len, "results": rows}
    if args.compare == "hf":
        result["speedup_total_tokens"] = rows[1]["total_tokens_per_s"] / rows[0]["total_tokens_per_s"]
    print_table(rows, ["engine", "requests", "elapsed_s", "requests_per_s", "output_tokens_per_s",
                       "total_tokens_per_s"])
    steps = rows[-1]["engine_steps"]
    print(f"pagoda engine: {steps['steps']} steps, {steps['ms_per_step']:.2f} ms/step, of which waiting for the "
          f"device {steps['device_wait_ms_per_step']:.2f} ms")
    if "speedup_total_tokens" in result:
        print(f"pagoda / transformers (total tokens/s): {result['speedup_total_tokens']:.1f}x")
    write_json(args.output_json, result)
    return result
