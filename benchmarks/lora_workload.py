"""Random LoRA adapters for the benchmarks (`pagoda bench throughput|latency --lora-adapters N --lora-rank R`):
PEFT directories written for the model's shape, every projection targeted, drawn straight in the model dtype
(A and B both non-zero, so every adapter changes every output). The base model runs first on an engine without
LoRA, then the same requests spread round-robin over the adapters on an engine with `enable_lora` (its slots
`max_lora_rank = R` wide, `--max-loras` of them): the ratio of the two is what adapters cost.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import tempfile


def add_lora_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-adapters", type=int, default=0,
                        help="also run the workload over this many random adapters (every projection), after the base "
                             "model on an engine without LoRA; --max-loras sets the GPU slots")
    parser.add_argument("--lora-rank", type=int, default=16, help="the random adapters' rank (also max_lora_rank)")


def lora_runs(args) -> list[dict]:
    """The engine overrides of each run: none without --lora-adapters; with it, the base model on an engine without
    LoRA, then the LoRA engine."""
    if not getattr(args, "lora_adapters", 0):
        return [{}]
    if args.lora_adapters < 0 or args.lora_rank < 1:
        raise ValueError("--lora-adapters must be >= 0 and --lora-rank >= 1")
    cpu_loras = args.max_cpu_loras or max(args.max_loras, args.lora_adapters)  # default: every adapter in host memory
    return [{"enable_lora": False},
            {"enable_lora": True, "max_lora_rank": args.lora_rank, "max_cpu_loras": cpu_loras}]


def random_adapters(hf_config: dict, num: int, rank: int, seed: int = 0, out_dir: str | None = None) -> list:
    """`num` PEFT adapters of `rank` on every LoRA-capable projection of the model (its config.json), in its dtype;
    returns their LoRARequests (ids 1..num). A: uniform(-1/sqrt(in), 1/sqrt(in)) as PEFT's init draws it; B:
    normal with std 1/sqrt(rank), lora_alpha = rank (scaling 1): each adapter moves every layer's output.
    Without `out_dir` they go to a temporary directory that is removed when the process exits."""
    import torch
    from safetensors.torch import save_file

    from engine.lora import CONFIG_FILE, WEIGHTS_FILE, LoRARequest, lora_module_shapes

    dtype = getattr(torch, hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    shapes = lora_module_shapes(hf_config)
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="pagoda-bench-lora-")
        atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # drawing 8B-sized adapters on the CPU takes seconds each
    requests = []
    for i in range(num):
        generator = torch.Generator(device).manual_seed(seed * 1_000_003 + i)
        tensors = {}
        for layer in range(int(hf_config["num_hidden_layers"])):
            for module, (in_features, out_features) in shapes.items():
                part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{module}"
                bound = in_features ** -0.5
                a = torch.rand(rank, in_features, generator=generator, device=device) * (2 * bound) - bound
                b = torch.randn(out_features, rank, generator=generator, device=device) * rank ** -0.5
                tensors[f"{name}.lora_A.weight"] = a.to(dtype).cpu()
                tensors[f"{name}.lora_B.weight"] = b.to(dtype).cpu()
        path = os.path.join(out_dir, f"adapter-{i + 1}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, WEIGHTS_FILE))
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(shapes),
                       "bias": "none"}, f)
        requests.append(LoRARequest(f"adapter-{i + 1}", i + 1, path))
    return requests


def spread(adapters: list, num: int) -> list:
    """One adapter a request, round-robin (None for every request when there are no adapters: the base model)."""
    return [adapters[i % len(adapters)] if adapters else None for i in range(num)]


def lora_label(overrides: dict, args) -> str | None:
    """The run's name in the table: None without --lora-adapters."""
    if "enable_lora" not in overrides:
        return None
    return f"{args.lora_adapters} x r{args.lora_rank}, {args.max_loras} slots" if overrides["enable_lora"] else "base"


def run_adapters(overrides: dict, args, hf_config: dict) -> list:
    """The adapters a run spreads its requests over: written for the LoRA run, none for the others."""
    return random_adapters(hf_config, args.lora_adapters, args.lora_rank, args.seed) if overrides.get("enable_lora") \
        else []
