"""The sampler alone: one step's sampling for each named setting (benchmarks/common.py) at several batch sizes, over
a Llama-3 vocabulary, with penalty histories as the model runner keeps them (prompt and outputs on the device).

`device_ms` is the device's time for the step (its kernels queued behind a spin, so no launch gap counts), `host_ms`
the host's time to launch it. `full sort` rows time the former way for the settings without penalties (sort the
vocabulary for top-k / top-p, softmax, an exponential race), on the same logits.

    pagoda bench sampler [--batch-sizes 1 64 256] [--vocab 128256] [--output-json sampler.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import SAMPLING_SETTINGS, device_name, print_table, write_json
from engine.sampling_params import SamplingParams
from workers.sampler import SamplingRow, SamplingTensors, apply_top_k_top_p, penalty_batch, sample_async
from workers.token_history import TokenHistory


def pagoda_step(name: str, batch: int, vocab: int, history_len: int, device: torch.device, gen: torch.Generator):
    """A function that samples one step of `batch` rows under the setting, as the model runner does."""
    params = SamplingParams(**SAMPLING_SETTINGS[name])
    prompt_len = history_len * 3 // 4
    histories = torch.randint(0, vocab, (batch, history_len), generator=gen).tolist()
    rows = [SamplingRow(params, h[:prompt_len], h[prompt_len:]) for h in histories]
    tensors = SamplingTensors.build(rows, vocab, device)
    history = TokenHistory(batch, history_len + 1024, device)
    slots = torch.tensor([history.add(rows[i].prompt_token_ids, rows[i].output_token_ids)
                          for i in tensors.penalty_rows], dtype=torch.long, device=device)
    logits = 2 * torch.randn(batch, vocab, generator=gen).to(device)
    width = [history_len]

    def step():
        penalties = None
        if tensors.penalty_rows:
            width[0] += 1
            penalties = penalty_batch(tensors, *history.read(slots, width[0]))
        sampled = sample_async(logits, rows, tensors=tensors, penalties=penalties, in_place=True)
        if penalties is not None:
            history.append(slots, sampled.tokens.index_select(0, tensors.penalty_index)[:, None])
        return sampled.tokens

    return step


def full_sort_step(name: str, batch: int, vocab: int, device: torch.device, gen: torch.Generator):
    setting = SAMPLING_SETTINGS[name]
    logits = 2 * torch.randn(batch, vocab, generator=gen).to(device)
    top_k = torch.full((batch,), setting.get("top_k", 0), dtype=torch.long, device=device)
    top_p = torch.full((batch,), setting.get("top_p", 1.0), device=device)

    def step():
        x = logits / setting["temperature"]
        if setting.get("top_k") or setting.get("top_p", 1.0) < 1.0:
            x = apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)

    return step


def time_step(step, device: torch.device, repeats: int) -> tuple[float, float]:
    """(device ms, host ms) per step, medians."""
    for _ in range(3):
        step()  # warm-up: kernels compile
    device_ms, host_ms = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)  # the host queues the whole step while the device spins
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        step()
        host_ms.append(1e3 * (time.perf_counter() - t0))
        if device.type == "cuda":
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
    return (statistics.median(device_ms) if device_ms else float("nan")), statistics.median(host_ms)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--history-len", type=int, default=768, help="prompt + output tokens of each row")
    parser.add_argument("--settings", nargs="+", choices=list(SAMPLING_SETTINGS), default=list(SAMPLING_SETTINGS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a smoke run: on shared cores more threads only contend
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch_sizes:
        for name in args.settings:
            impls = {"pagoda": pagoda_step(name, batch, args.vocab, args.history_len, device, gen)}
            if "repetition_penalty" not in SAMPLING_SETTINGS[name] and name != "greedy":
                impls["full sort"] = full_sort_step(name, batch, args.vocab, device, gen)
            for impl, step in impls.items():
                device_ms, host_ms = time_step(step, device, args.repeats)
                rows.append({"setting": name, "batch": batch, "impl": impl, "device_ms": device_ms,
                             "host_ms": host_ms})
    print_table(rows, ["setting", "batch", "impl", "device_ms", "host_ms"])
    result = {"benchmark": "sampler", "device": device_name(), "vocab": args.vocab,
              "history_len": args.history_len, "results": rows}
    write_json(args.output_json, result)
    return result

