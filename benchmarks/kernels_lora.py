"""Batched LoRA (kernels/lora.py), for `python -m benchmarks.kernels --only lora` (and `--tune --only lora`).

Llama-3-8B's projections (qkv 4096 -> 4096 + 1024 + 1024 in three slices, o 4096 -> 4096, gate_up 4096 ->
2 x 14336 in two, down 14336 -> 4096) with 8 rank-16 adapters in slots: decode batches of 1, 64 and 256 sequences
(each row its own adapter, drawn at random) and a 2048-token prefill (8 sequences of 256 tokens, an adapter each).

    base matmul     torch.matmul of the layer's bf16 weight (cuBLAS): the baseline
    lora triton     shrink + expand, the LoRA delta alone, added into the layer's output, rows as they come
    lora sorted     the same tiling the rows sorted by slot (`order`, argsorted outside the timing, as the engine's
                    InputBuffers do once a step): a decode tile then walks a few slots instead of up to 8
    base + lora     the base matmul and the sorted shrink + expand, as a layer with adapters runs
    lora torch ref  the references (a loop over the adapters in use, host syncs: eager)

Each is scored in the bytes it must move: the LoRA's are x read, the A and B of the adapters in use read once,
y written and read (float32), the output read and written; the base matmul's its weight, x and its output. After
the run, `lora overhead` lines give "lora triton" and "lora sorted" over "base matmul" for every case: the issue
asks for 8 rank-16 adapters at >= 85% of the base model's throughput (256 requests) and batch-1 decode within 10%.
"""

import torch

from kernels.lora import MAX_SHRINK_PARTS, lora_expand_ref, lora_expand_triton, lora_shrink_ref, lora_shrink_triton

GPU_LORA = dict(layers={"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                        "down": (14336, (4096,))},
                rank=16, num_adapters=8, decode_batches=[1, 64, 256], prefill_tokens=[2048], prefill_seqs=8)
SMOKE_LORA = dict(layers={"qkv": (64, (64, 32, 32)), "down": (96, (64,))}, rank=16, num_adapters=4,
                  decode_batches=[1, 8], prefill_tokens=[40], prefill_seqs=4)
# split K's partial sums at rank 16: at most MAX_SHRINK_PARTS (kernels/lora.py) a tile
TUNE_SHRINK = [dict(BLOCK_M=m, SPLIT_K=s) for m in (16, 32, 64) for s in (1, 4, 8, 16, 32)
               if s * m * 16 <= MAX_SHRINK_PARTS]
# OUT_FIRST: out's tile loaded before the slot walk (its latency hidden under the walk's loads and dots); off by
# default: on an H100 faster at 256 rows, slower at a 2,048-token prefill (h100-kernels-tune-lora-parts.json)
TUNE_EXPAND = [dict(BLOCK_M=m, BLOCK_N=n) for m in (16, 64) for n in (64, 128)] + [
    dict(OUT_FIRST=True), dict(BLOCK_M=64, BLOCK_N=128, OUT_FIRST=True)]


def lora_inputs(num_tokens: int, in_features: int, widths: tuple, lora_cfg: dict, prefill: bool, dtype, device):
    """x, the layer's weight, stacked A and B, the slots (random per row for decode, per sequence for prefill) and
    the slices' starts."""
    gen = torch.Generator(device=device).manual_seed(0)
    rank, adapters, n = lora_cfg["rank"], lora_cfg["num_adapters"], sum(widths)
    x = torch.randn(num_tokens, in_features, generator=gen, device=device).to(dtype)
    weight = (torch.randn(n, in_features, generator=gen, device=device) * in_features ** -0.5).to(dtype)
    lora_a = (torch.randn(adapters, len(widths), rank, in_features, generator=gen, device=device)
              * in_features ** -0.5).to(dtype)
    lora_b = (torch.randn(adapters, n, rank, generator=gen, device=device) * rank ** -0.5).to(dtype)
    if prefill:
        per_seq = -(-num_tokens // lora_cfg["prefill_seqs"])
        slots = (torch.arange(num_tokens, device=device) // per_seq) % adapters
    else:
        slots = torch.randint(0, adapters, (num_tokens,), generator=gen, device=device)
    starts = tuple(sum(widths[:i]) for i in range(len(widths)))
    return x, weight, lora_a, lora_b, slots.to(torch.int32), starts


def lora_bytes(x, weight, lora_a, lora_b, slots) -> dict:
    num_tokens, n = x.shape[0], weight.shape[0]
    used = int(slots.unique().numel())
    size = x.element_size()
    lora = (x.numel() * size + used * lora_a[0].numel() * size + used * lora_b[0].numel() * size
            + 2 * lora_a.shape[1] * num_tokens * lora_a.shape[2] * 4 + 2 * num_tokens * n * size)
    base = weight.numel() * size + x.numel() * size + num_tokens * n * size
    return dict(bytes=lora, impl_bytes={"base matmul": base, "base + lora": base + lora})


def _cases(lora_cfg: dict):
    for layer, (in_features, widths) in lora_cfg["layers"].items():
        for rows in lora_cfg["decode_batches"]:
            yield layer, in_features, widths, rows, False, f"decode batch {rows}"
        for rows in lora_cfg["prefill_tokens"]:
            yield layer, in_features, widths, rows, True, f"prefill {rows} tokens"


def bench_lora(runner, cfg: dict, lora_cfg: dict):
    """The Triton shrink + expand against the base layer's matmul and the torch references."""
    for layer, in_features, widths, rows, prefill, case in _cases(lora_cfg):

        def build(in_features=in_features, widths=widths, rows=rows, prefill=prefill):
            x, weight, lora_a, lora_b, slots, starts = lora_inputs(rows, in_features, widths, lora_cfg, prefill,
                                                                   cfg["dtype"], runner.device)
            out = torch.matmul(x, weight.T)

            def ref():
                lora_expand_ref(out, lora_shrink_ref(x, lora_a, slots), lora_b, slots, starts)

            ref.eager = True  # the references loop over the adapters in use (host syncs): no graph captures them
            impls = {"base matmul": lambda: torch.matmul(x, weight.T, out=out)}
            order = torch.argsort(slots).to(torch.int32)  # the engine's InputBuffers sort once a step, on the host
            if runner.use_triton:
                impls["lora triton"] = lambda: lora_expand_triton(out, lora_shrink_triton(x, lora_a, slots), lora_b,
                                                                  slots, starts)
                impls["lora sorted"] = lambda: lora_expand_triton(
                    out, lora_shrink_triton(x, lora_a, slots, order=order), lora_b, slots, starts, order=order)
                impls["base + lora"] = lambda: (torch.matmul(x, weight.T, out=out), impls["lora sorted"]())
            impls["lora torch ref"] = ref

            def check():
                error = 0.0
                for rows in (None, order):
                    y = lora_shrink_triton(x, lora_a, slots, order=rows)
                    torch.testing.assert_close(y, lora_shrink_ref(x, lora_a, slots), atol=1e-3, rtol=1e-3)
                    expected, got = out.clone(), out.clone()
                    lora_expand_ref(expected, y, lora_b, slots, starts)
                    lora_expand_triton(got, y, lora_b, slots, starts, order=rows)
                    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
                    error = max(error, (got.float() - expected.float()).abs().max().item())
                return error

            return impls, lora_bytes(x, weight, lora_a, lora_b, slots), check if runner.use_triton else None

        runner.case(f"lora {layer}", f"{case} r{lora_cfg['rank']}", build)


def bench_tune_lora(runner, cfg: dict, lora_cfg: dict):
    """TUNE_SHRINK and TUNE_EXPAND on the qkv and down layers: kernels/lora.py's shrink_config / expand_config
    should be the best rows."""
    for layer, in_features, widths, rows, prefill, case in _cases(lora_cfg):
        if layer not in ("qkv", "down"):
            continue

        def build(in_features=in_features, widths=widths, rows=rows, prefill=prefill):
            x, weight, lora_a, lora_b, slots, starts = lora_inputs(rows, in_features, widths, lora_cfg, prefill,
                                                                   cfg["dtype"], runner.device)
            out = torch.matmul(x, weight.T)
            y = lora_shrink_triton(x, lora_a, slots)
            impls = {"shrink default": lambda: lora_shrink_triton(x, lora_a, slots)}
            for c in TUNE_SHRINK:
                impls["shrink m{BLOCK_M} split{SPLIT_K}".format(**c)] = lambda c=c: lora_shrink_triton(
                    x, lora_a, slots, config=c)
            impls["expand default"] = lambda: lora_expand_triton(out, y, lora_b, slots, starts)
            for c in TUNE_EXPAND:
                impls["expand " + " ".join(f"{k}={v}" for k, v in c.items())] = lambda c=c: lora_expand_triton(
                    out, y, lora_b, slots, starts, config=c)
            return impls, lora_bytes(x, weight, lora_a, lora_b, slots), None

        runner.case(f"tune lora {layer}", case, build)


def print_lora_overhead(results: list[dict]) -> None:
    """Per case: the LoRA kernels' time over the base matmul's (the step's added cost on that projection)."""
    times = {(r["kernel"], r["case"], r["impl"]): r["ms"] for r in results if r["kernel"].startswith("lora ")}
    for (kernel, case, impl), ms in times.items():
        base = times.get((kernel, case, "base matmul"))
        if impl == "lora triton" and base:
            with_lora = times.get((kernel, case, "base + lora"), float("nan"))
            ordered = times.get((kernel, case, "lora sorted"), float("nan"))
            print(f"lora overhead {kernel[5:]:<8} {case:<28} {100 * ms / base:6.1f}% of the base matmul, sorted "
                  f"{100 * ordered / base:6.1f}% (base + lora {with_lora / base:.3f}x)")
