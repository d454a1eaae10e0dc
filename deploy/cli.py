"""The `pagoda` command line."""

from __future__ import annotations

import argparse
import sys

_DEFAULT_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "import os\nimport sys\n"]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine knobs shared by every command that builds an engine."""
    parser.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: built-in tiny)")
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
    parser.add_argument("--enforce-eager", action="store_true")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, load_format=args.load_format,
                enforce_eager=args.enforce_eager)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    prompts = args.prompt or _DEFAULT_PROMPTS
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"--- {out.prompt!r}\n{out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]")
    llm.shutdown()
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from workers.tiny_model import make_tiny_model

    make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} checkpoint to {args.dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a few prompts offline and print them")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in ones")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny-model", help="write the built-in tiny checkpoint (random weights) to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
