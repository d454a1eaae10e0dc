"""Quality of a quantized model against its full-precision self, teacher-forced at fixed positions:

    pagoda bench quality --model DIR --quantization fp8 --kv-cache-dtype fp8 [--positions 256]
    pagoda bench quality --model DIR --quantization awq|gptq [--int4-group-size 128] [--int4-sym|--no-int4-sym]

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

`--quantization awq` or `gptq` on a float checkpoint first writes, into a temporary directory, its round-to-nearest
int4 checkpoint (checkpoints/int4_rtn.py, packed as AutoAWQ / AutoGPTQ pack: AWQ asymmetric in its GEMM layout,
GPTQ v1 symmetric by default or asymmetric with `--no-int4-sym`, no act-order) with `--int4-group-size` groups, or
the largest halving of it that every linear's input features are a multiple of (SmolLM2-135M's hidden 576: 64),
said in the output; and beside it the float32 checkpoint of the dequantized weights. Pagoda runs on the int4 one;
two more figures: transformers on the dequantized weights against the unquantized model (the quantization error
alone, the row "transformers, int4 weights dequantized"), and Pagoda's int4 run against that dequantized model
(`int4.pagoda_vs_dequantized`: the kernels' error alone, float tolerance in float32). The FP8 bar is not applied.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
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
    parser.add_argument("--int4-group-size", type=int, default=128,
                        help="awq / gptq on a float model: the group of the int4 checkpoint written (or the largest "
                             "halving of it that divides every linear's input features)")
    parser.add_argument("--int4-sym", action=argparse.BooleanOptionalAction, default=None,
                        help="gptq: symmetric (default) or asymmetric zero points; awq is always asymmetric")
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


def int4_format(args, model_dir: str):
    """awq / gptq on a float checkpoint: the Int4Format to write and a line saying it (group chosen); None when
    the quantization is another or the checkpoint carries its own quantization_config."""
    from checkpoints import int4_rtn

    if args.quantization not in ("awq", "gptq") or not os.path.isdir(model_dir):
        return None
    with open(os.path.join(model_dir, "config.json")) as f:
        if "quantization_config" in json.load(f):
            return None
    if args.quantization == "awq" and args.int4_sym:
        raise ValueError("--int4-sym: AWQ checkpoints are asymmetric (zero points); it is for gptq")
    sym = args.quantization == "gptq" and args.int4_sym is not False
    in_features = int4_rtn.linear_in_features(int4_rtn.read_tensors(model_dir))
    group = int4_rtn.fit_group_size(in_features, args.int4_group_size)
    fmt = int4_rtn.Int4Format(args.quantization, group, sym=sym)
    note = f"{fmt.name} round-to-nearest (4 bits, group {group}"
    if group != args.int4_group_size:
        misfit = sorted({k for k in in_features.values() if k % args.int4_group_size})
        note += f": input features {misfit} are not multiples of {args.int4_group_size}"
    note += ", " + ("asymmetric, zero points" if not sym else "symmetric") + ")"
    return fmt, note


def main(args: argparse.Namespace) -> dict:
    from checkpoints.source import resolve_model
    from engine.tokenizer import load_tokenizer

    model_dir = resolve_model(args.model)  # None: the built-in SmolLM2-135M-Instruct
    ids = passage_ids(load_tokenizer(model_dir), args.positions)
    start = time.perf_counter()
    ref = reference_logprobs(args.reference or model_dir, ids)
    with tempfile.TemporaryDirectory(prefix="pagoda-int4-") as tmp:
        int4 = int4_format(args, model_dir)
        quantized_dir = model_dir
        if int4 is not None:
            from checkpoints.int4_rtn import write_int4_checkpoint

            quantized_dir, oracle_dir = os.path.join(tmp, int4[0].name), os.path.join(tmp, "dequantized")
            write_int4_checkpoint(model_dir, quantized_dir, oracle_dir, int4[0])
            print(f"int4 checkpoint: {int4[1]}")
            oracle = reference_logprobs(oracle_dir, ids)
        runs = [(None, "auto"), (args.quantization, args.kv_cache_dtype)]
        if args.ablations:
            runs += [(args.quantization, "auto"), (None, args.kv_cache_dtype)]
        rows, ours = [], []
        for quantization, kv in runs:
            name = f"pagoda, weights {quantization or 'as stored'}, kv {kv}" if rows else "pagoda, unquantized"
            worker = build_worker(args, quantized_dir if quantization else model_dir, quantization, kv, len(ids))
            ours.append(pagoda_logprobs(worker, ids, args.chunk))
            worker.shutdown()
            rows.append({"run": name, **compare(ref, ours[-1], args.positions)})
        if int4 is not None:
            rows.append({"run": "transformers, int4 weights dequantized", **compare(ref, oracle, args.positions)})
    for row in rows:
        print(f"{row['run']:<48} top-1 {100 * row['top1_agreement']:6.2f}%  mean |dlogprob| "
              f"{row['mean_abs_delta_logprob']:.4f}  max {row['max_abs_delta_logprob']:.4f}")
    result = {"benchmark": "quality", "device": device_name(), "model": model_dir, "dtype": args.dtype,
              "chunk": args.chunk, "kv_scales": args.kv_scales, "results": rows}
    if int4 is not None:
        kernels = compare(oracle, ours[1], args.positions)
        print(f"{'pagoda int4 against transformers dequantized':<48} top-1 {100 * kernels['top1_agreement']:6.2f}%  "
              f"mean |dlogprob| {kernels['mean_abs_delta_logprob']:.2e}  max {kernels['max_abs_delta_logprob']:.2e}"
              f" ({time.perf_counter() - start:.0f} s)")
        result["int4"] = {"format": int4[0].name, "checkpoint": int4[1], "group_size": int4[0].group_size,
                          "requested_group_size": args.int4_group_size, "sym": int4[0].sym,
                          "quantization_config": int4[0].quantization_config(), "pagoda_vs_dequantized": kernels}
    else:
        quantized = rows[1]
        result["target_met"] = quantized["top1_agreement"] >= 0.97 and quantized["mean_abs_delta_logprob"] <= 0.05
        print(f"target (>= 97% top-1, mean |dlogprob| <= 0.05): {'met' if result['target_met'] else 'NOT MET'} "
              f"({time.perf_counter() - start:.0f} s)")
    write_json(args.output_json, result)
    return result
