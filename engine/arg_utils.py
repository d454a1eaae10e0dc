"""Command-line flags for `EngineArgs`, shared by `pagoda` and the benchmarks (argparse only).

Flags carry vLLM's names where they mean what vLLM's mean; their defaults are EngineArgs' (engine/config.py), so a
flag left out is the same as the field left out.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from engine.config import KV_OFFLOAD_POLICIES, EngineArgs

_DEFAULTS = {f.name: f.default for f in fields(EngineArgs)}


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Engine knobs shared by every command that builds an engine. model_positional: `pagoda serve MODEL` as
    `vllm serve MODEL` (the --model flag works too)."""
    if model_positional:
        parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                            help="the model (same as --model)")
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory, a .gguf file, a Hugging Face repo id in the local cache, or "
                             "'tiny' (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"])
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS["gpu_memory_utilization"])
    parser.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS["max_num_batched_tokens"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                        default=_DEFAULTS["enable_prefix_caching"])
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="same as --no-enable-prefix-caching")
    parser.add_argument("--swap-space", "--kv-offload-gib", dest="swap_space", type=float,
                        default=_DEFAULTS["swap_space"], metavar="GIB",
                        help="GiB of host memory per GPU for a second KV tier: computed blocks are also written there "
                             "(--kv-offload-policy says when), and a prefix the GPU pool has evicted (or a preempted "
                             "request's) is copied back instead of computed again (default 0: none; needs prefix "
                             "caching)")
    parser.add_argument("--onload-gb-per-s", type=float, default=_DEFAULTS["onload_gb_per_s"],
                        help="the host tier's cost model: one GPU's host-to-device copy rate (GB/s), as `pagoda bench "
                             "kv-tier-cost` measures it")
    parser.add_argument("--onload-latency-s", type=float, default=_DEFAULTS["onload_latency_s"],
                        help="the host tier's cost model: the fixed cost of a step's copies back (seconds)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=_DEFAULTS["prefill_tokens_per_s"],
                        help="the host tier's cost model: the model's prefill rate; a prefix on the host shorter than "
                             "what copying back pays for is computed again")
    parser.add_argument("--min-onload-blocks", type=int, default=None,
                        help="the fewest host-tier blocks copied back rather than computed (default: from the cost "
                             "model)")
    parser.add_argument("--kv-offload-policy", choices=KV_OFFLOAD_POLICIES, default=_DEFAULTS["kv_offload_policy"],
                        help="when the host tier gets a block: write-through (every computed block, default) or "
                             "write-back (a cached block the GPU pool evicts; nothing while the pool has room)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=_DEFAULTS["tensor_parallel_size"])
    parser.add_argument("--seed", type=int, default=_DEFAULTS["seed"])
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "random"])
    parser.add_argument("--preset", default=None,
                        help="a real-sized shape with random weights instead of --model (e.g. llama-3-8b)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--compilation-config", "-O", type=_compilation_config, default=None, metavar="LEVEL|JSON",
                        help="torch.compile, as vLLM's: -O3 or '{\"level\": 3}' compiles the model's decoder "
                             "layers around Pagoda's kernels (inductor's code between its GEMMs and attention); 0 (the "
                             "default) runs it eagerly with Pagoda's hand-fused kernels")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="refused: Pagoda runs only its own model code (see the README's model list)")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template file (or text) that replaces "
                                                              "the tokenizer's")
    parser.add_argument("--quantization", default=None, choices=["fp8", "awq", "gptq", "gguf", "none"],
                        help="fp8: FP8 weights (per output channel) and activations (per token), quantized at load; "
                             "awq / gptq: name the checkpoint's own int4 method (read from its config anyway; "
                             "with --preset or --load-format random, a default layout: AWQ or GPTQ 4 bits, group "
                             "128, drawn packed); "
                             "gguf: a .gguf model's linears served from their blocks, not dequantized; none: a .gguf "
                             "dequantized at load (the default)")
    parser.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\' (n-gram prompt lookup) or '
                             '\'{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}\' (a smaller '
                             'model with the same tokenizer)')
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: the KV cache in float8_e4m3fn (twice the tokens), scales per KV head")
    parser.add_argument("--enable-lora", action="store_true",
                        help="LoRA adapters per request (PEFT directories; `pagoda serve --lora-modules` names them)")
    parser.add_argument("--max-loras", type=int, default=_DEFAULTS["max_loras"],
                        help="adapters resident on the GPU at once (a step runs at most this many)")
    parser.add_argument("--max-lora-rank", type=int, default=_DEFAULTS["max_lora_rank"],
                        help="the largest adapter rank accepted (the slots are this wide)")
    parser.add_argument("--max-cpu-loras", type=int, default=_DEFAULTS["max_cpu_loras"],
                        help="adapters cached in each worker's host memory (default: --max-loras)")


def _compilation_config(text: str) -> int | dict:
    """-O3, -O 3 or --compilation-config '{"level": 3}' (the value checked by CompilationConfig)."""
    text = text.strip()
    return int(text) if text.isdigit() else _json_object(text)


def _json_object(text: str) -> dict:
    """A flag's JSON object value (argparse reports the ValueError as a usage error naming the flag)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def engine_args(args: argparse.Namespace, **overrides) -> EngineArgs:
    """The parsed flags as EngineArgs; ValueError for a flag Pagoda cannot honour."""
    if getattr(args, "trust_remote_code", False):
        raise ValueError("--trust-remote-code: Pagoda does not run model code from checkpoints; it serves the "
                         "architectures it implements itself (the README lists them)")
    model = getattr(args, "model_arg", None) or args.model
    load_format = args.load_format
    if getattr(args, "preset", None):
        from checkpoints.presets import preset_dir  # lazy: see create_engine_config (engine/config.py)

        model, load_format = preset_dir(args.preset), "random"
    values = dict(model=model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                  block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  enable_prefix_caching=args.enable_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
                  seed=args.seed, load_format=load_format, enforce_eager=args.enforce_eager,
                  chat_template=args.chat_template, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, swap_space=args.swap_space,
                  onload_gb_per_s=args.onload_gb_per_s, onload_latency_s=args.onload_latency_s,
                  prefill_tokens_per_s=args.prefill_tokens_per_s, min_onload_blocks=args.min_onload_blocks,
                  kv_offload_policy=args.kv_offload_policy,
                  speculative_config=getattr(args, "speculative_config", None),
                  compilation_config=getattr(args, "compilation_config", None))
    for name in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"):  # not every parser has them
        values[name] = getattr(args, name, _DEFAULTS[name])
    return EngineArgs(**(values | overrides))
