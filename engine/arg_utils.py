"""Command-line flags for the engine's settings, shared by `pagoda` and the benchmarks (argparse only)."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine knobs shared by every command that builds an engine."""
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory, a .gguf file, a Hugging Face repo id in the local cache, or "
                             "'tiny' (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "random"])
    parser.add_argument("--preset", default=None,
                        help="a real-sized shape with random weights instead of --model (e.g. llama-3-8b)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template file (or text) that replaces "
                                                              "the tokenizer's")


def engine_kwargs(args: argparse.Namespace) -> dict:
    model, load_format = args.model, args.load_format
    if getattr(args, "preset", None):
        from workers.presets import preset_dir  # lazy: engine imports no other package at import time

        model, load_format = preset_dir(args.preset), "random"
    return dict(model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, load_format=load_format,
                enforce_eager=args.enforce_eager, chat_template=args.chat_template)
