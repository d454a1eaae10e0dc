"""Quality of a quantized model against its full-precision self, teacher-forced at fixed positions:

    pagoda bench quality --model DIR --quantization fp8 --kv-cache-dtype fp8 [--positions 256]

transformers (float32) reads a fixed English passage (PASSAGE, as many copies as the positions need) and gives
the log-softmax at every position; Pagoda, built as `pagoda` would build it from the same flags, runs the same
tokens through its real paths (the KV pool in its dtype, the kernels of the device) in chunks of `--chunk`
tokens (the default: one prefill; 1: every position a decode step). At each of the first `--positions` positions:

    top-1 agreement     Pagoda's most likely next token is transformers'
    |Δ logprob|         |Pagoda's logprob - transformers'| of transformers' most likely token (mean, max)

The issue's bar for FP8 weights + FP8 KV: agreement >= 97%, mean |Δ logprob| <= 0.05. Without --model, the built-in
SmolLM2-135M-Instruct (checkpoints/builtin.py); any Hugging Face checkpoint directory of a supported family works
(an FP8 checkpoint with `--reference` its full-precision source). `--ablations` adds FP8 weights alone and FP8 KV
alone; `--kv-scales layer` calibrates one KV scale per layer instead of per head (the comparison behind the
default). Runs on one rank (tensor_parallel_size 1).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import device_name, write_json

PASSAGE = (
    "The river begins high in the mountains, where snow melts each spring and runs down through narrow valleys. "
    "Farmers along its banks have grown rice, wheat and barley for thousands of years, and the towns that grew "
    "beside them still hold markets every week. In the old capital, a stone bridge with seven arches crosses the "
    "water; it was built in the twelfth century and repaired after a great flood in 1887. Travelers who arrive "
    "by train can walk from the station to the bridge in about twenty minutes, passing the cathedral, the public "
    "library and a small museum of clocks. The museum's oldest piece is a water clock that once told the hours "
    "to the monks of a nearby monastery. Further south the river widens and slows, and large ships carry grain, "
    "coal and machinery to the port at its mouth. Scientists who study the delta measure how much sand and silt "
    "the river brings to the sea each year, and how the coastline moves as a result. Their reports suggest that "
    "dams built upstream have reduced the flow of sediment by more than half since the middle of the last "
    "century, so that some beaches are now shrinking. Local governments are trying new ways to protect the "
    "shore: planting grasses that hold the dunes together, rebuilding wetlands, and asking engineers to design "
    "gates that let fish pass while holding back storm surges. Children in the region learn about the river in "
    "school, and many of them spend their summers swimming, fishing or sailing on it. "
)


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=0, help="tokens per forward (0: the whole passage at once)")
    parser.add_argument("--kv-scales", choices=["head", "layer"], default="head")
    parser.add_argument("--reference", default=None,
                        help="the full-precision checkpoint to compare with (default: --model; give it for an FP8 one)")
    parser.add_argument("--ablations", action="store_true",
                        help="also run the FP8 weights alone (kv auto) and the FP8 KV alone (weights as stored)")
    parser.add_argument("--output-json", default=None)


def passage_ids(tokenizer, num_positions: int) -> list[int]:
    ids = tokenizer.encode(PASSAGE)
    while len(ids) < num_positions + 1:
        ids += tokenizer.encode(PASSAGE, add_special_tokens=False)
    return ids[: num_positions + 1]


@torch.inference_mode()
def reference_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """transformers in float32 on CPU: [L, vocab] log-softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@torch.inference_mode()
def pagoda_logprobs(worker, ids: list[int], chunk: int) -> torch.Tensor:
    """One sequence through the worker's model and KV pool, `chunk` tokens a forward: [L, vocab] log-softmax."""
    from workers.layers.attention import AttentionMetadata

    device, caches = worker.device, worker.runner.kv_caches
    block_size = caches[0][0].shape[1]
    num_blocks = -(-len(ids) // block_size)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    chunk = chunk or len(ids)
    out = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, device=device),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device), block_tables=table,
            max_query_len=end - start, is_decode_only=end - start == 1)
        hidden = worker.model(torch.tensor(ids[start:end], device=device), torch.arange(start, end, device=device),
                              caches, meta)
        out.append(torch.log_softmax(worker.model.compute_logits(hidden).float().cpu(), -1))
    return torch.cat(out)


def compare(ref: torch.Tensor, ours: torch.Tensor, num_positions: int) -> dict:
    ref, ours = ref[:num_positions], ours[:num_positions]
    top = ref.argmax(-1)
    delta = (ours.gather(-1, top[:, None]) - ref.gather(-1, top[:, None])).abs().squeeze(-1)
    return {"positions": num_positions, "top1_agreement": (ours.argmax(-1) == top).float().mean().item(),
            "mean_abs_delta_logprob": delta.mean().item(), "max_abs_delta_logprob": delta.max().item()}


def build_worker(args, model_dir: str, quantization, kv_cache_dtype: str, num_tokens: int):
    from engine.arg_utils import engine_args
    from workers.worker import Worker

    num_blocks = -(-num_tokens // args.block_size) + 1
    config = engine_args(args, model=model_dir, load_format="auto", quantization=quantization,
                         kv_cache_dtype=kv_cache_dtype, enforce_eager=True,
                         num_kv_blocks=num_blocks).create_engine_config()
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    if kv_cache_dtype == "fp8" and args.kv_scales == "layer":
        from workers.kv_scales import calibrate_kv_scales

        calibrate_kv_scales(worker.model, worker.device, worker.dtype, config.model.hf_config.get("bos_token_id"),
                            granularity="layer")
    worker.init_kv_cache(num_blocks)
    return worker


def main(args: argparse.Namespace) -> dict:
    from checkpoints.source import resolve_model
    from engine.tokenizer import load_tokenizer

    model_dir = resolve_model(args.model)  # None: the built-in SmolLM2-135M-Instruct
    ids = passage_ids(load_tokenizer(model_dir), args.positions)
    start = time.perf_counter()
    ref = reference_logprobs(args.reference or model_dir, ids)
    runs = [(None, "auto"), (args.quantization, args.kv_cache_dtype)]
    if args.ablations:
        runs += [(args.quantization, "auto"), (None, args.kv_cache_dtype)]
    rows = []
    for quantization, kv in runs:
        name = f"pagoda, weights {quantization or 'as stored'}, kv {kv}" if rows else "pagoda, unquantized"
        worker = build_worker(args, model_dir, quantization, kv, len(ids))
        row = {"run": name, **compare(ref, pagoda_logprobs(worker, ids, args.chunk), args.positions)}
        worker.shutdown()
        rows.append(row)
        print(f"{name:<48} top-1 {100 * row['top1_agreement']:6.2f}%  mean |dlogprob| "
              f"{row['mean_abs_delta_logprob']:.4f}  max {row['max_abs_delta_logprob']:.4f}")
    quantized = rows[1]
    passed = quantized["top1_agreement"] >= 0.97 and quantized["mean_abs_delta_logprob"] <= 0.05
    print(f"target (>= 97% top-1, mean |dlogprob| <= 0.05): {'met' if passed else 'NOT MET'} "
          f"({time.perf_counter() - start:.0f} s)")
    result = {"benchmark": "quality", "device": device_name(), "model": model_dir, "dtype": args.dtype,
              "chunk": args.chunk, "kv_scales": args.kv_scales, "results": rows, "target_met": passed}
    write_json(args.output_json, result)
    return result
