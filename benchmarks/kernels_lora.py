"""Batched LoRA (kernels/lora.py, kernels/lora_fused.py), for `python -m benchmarks.kernels --only lora`
(and `--tune --only lora`).

Llama-3-8B's projections (qkv 4096 -> 4096 + 1024 + 1024 in three slices, o 4096 -> 4096, gate_up 4096 ->
2 x 14336 in two, down 14336 -> 4096) with 8 rank-16 adapters in slots: decode batches of 1 to 256 sequences
(each row its own adapter, drawn at random) and a 2048-token prefill (8 sequences of 256 tokens, an adapter each).

    base matmul         torch.matmul of the layer's bf16 weight (cuBLAS): the baseline
    lora triton         shrink + expand, the LoRA delta alone, added into the layer's output (two launches)
    lora fused          the fused kernel (one launch, y in registers), at every batch: where it stops paying is
                        where kernels/lora_fused.py's FUSED_MAX_TOKENS belongs
    lora sorted         shrink + expand tiling the rows sorted by slot (`order`, argsorted outside the timing, as the
                        engine does once a step): a decode tile then walks 1-2 slots instead of up to 8
    base + lora         the base matmul and the delta as a layer runs it (lora_apply: fused up to FUSED_MAX_TOKENS,
                        else shrink + expand on the rows sorted by slot)
    lora torch ref      the references (a loop over the adapters in use, host syncs: eager)
  gate_up only, the activation included (what the MLP runs):
    silu unfused        shrink + expand + silu_and_mul (the expand reads and writes [T, 2I], the activation reads it)
    silu fused          shrink + the expand fused into the SiLU-and-mul ([T, 2I] read once, [T, I] written)
    silu fused sorted   the same on the rows sorted by slot
    silu base           silu_and_mul alone: the base model's share

Each is scored in the bytes it must move: the LoRA's are x read, the A and B of the adapters in use read once,
y written and read (float32), the output read and written; the base matmul's its weight, x and its output. After
the run, `lora overhead` lines give "lora triton" and "lora fused" over "base matmul" for every case, and
`lora silu` lines the fused activation against the unfused one: the issue asks for 8 rank-16 adapters at >= 85%
of the base model's throughput (256 requests) and batch-1 decode within 10%.
"""

import torch

from kernels.activation import silu_and_mul_triton
from kernels.lora import lora_expand_ref, lora_expand_triton, lora_shrink_ref, lora_shrink_triton
from kernels.lora_fused import lora_apply, lora_expand_silu_triton, lora_fused_triton

GPU_LORA = dict(layers={"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                        "down": (14336, (4096,))},
                rank=16, num_adapters=8, decode_batches=[1, 4, 8, 16, 64, 256], prefill_tokens=[2048], prefill_seqs=8)
SMOKE_LORA = dict(layers={"qkv": (64, (64, 32, 32)), "gate_up": (64, (48, 48)), "down": (96, (64,))}, rank=16,
                  num_adapters=4,
                  decode_batches=[1, 8], prefill_tokens=[40], prefill_seqs=4)
TUNE_SHRINK = [dict(BLOCK_M=m, SPLIT_K=s) for m in (16, 32, 64) for s in (1, 4, 16)]
TUNE_EXPAND = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w) for m in (16, 64, 128) for n in (64, 128, 256) for w in (4, 8)]
TUNE_FUSED = [dict(N_CHUNKS=c, BLOCK_K=k, num_warps=w) for c in (1, 2, 4, 8) for k in (64, 128) for w in (4, 8)]
TUNE_SILU = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w) for m in (32, 64, 128) for n in (64, 128) for w in (4, 8)]


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
    y_round_trip = 2 * lora_a.shape[1] * num_tokens * lora_a.shape[2] * 4
    lora = (x.numel() * size + used * lora_a[0].numel() * size + used * lora_b[0].numel() * size
            + y_round_trip + 2 * num_tokens * n * size)
    base = weight.numel() * size + x.numel() * size + num_tokens * n * size
    # the activation: [T, 2I] read, [T, I] written; unfused, the expand's read and write of [T, 2I] come first
    silu = num_tokens * n * size * 3 // 2
    return dict(bytes=lora, impl_bytes={"base matmul": base, "base + lora": base + lora,
                                        "lora fused": lora - y_round_trip, "silu base": silu,
                                        "silu fused sorted": lora - 2 * num_tokens * n * size + silu,
                                        "silu unfused": lora + silu, "silu fused": lora - 2 * num_tokens * n * size
                                        + silu})


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
                impls["lora fused"] = lambda: lora_fused_triton(out, x, lora_a, lora_b, slots, starts)
                impls["lora sorted"] = lambda: lora_expand_triton(
                    out, lora_shrink_triton(x, lora_a, slots, order=order), lora_b, slots, starts, order=order)
                impls["base + lora"] = lambda: (torch.matmul(x, weight.T, out=out), lora_apply(
                    out, x, lora_a, lora_b, slots, starts, use_kernel=True, order=order))
                if len(widths) == 2:  # gate_up: its activation, unfused and fused
                    impls.update(_silu_impls(out, x, lora_a, lora_b, slots, order))
            impls["lora torch ref"] = ref

            def check():
                y = lora_shrink_triton(x, lora_a, slots)
                torch.testing.assert_close(y, lora_shrink_ref(x, lora_a, slots), atol=1e-3, rtol=1e-3)
                expected, got, fused = out.clone(), out.clone(), out.clone()
                lora_expand_ref(expected, y, lora_b, slots, starts)
                lora_expand_triton(got, y, lora_b, slots, starts)
                torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
                lora_fused_triton(fused, x, lora_a, lora_b, slots, starts)
                torch.testing.assert_close(fused, expected, atol=1e-2, rtol=1e-2)
                order, ordered = torch.argsort(slots).to(torch.int32), out.clone()
                lora_expand_triton(ordered, lora_shrink_triton(x, lora_a, slots, order=order), lora_b, slots, starts,
                                   order=order)
                torch.testing.assert_close(ordered, expected, atol=1e-2, rtol=1e-2)
                if len(widths) == 2:
                    torch.testing.assert_close(lora_expand_silu_triton(out, y, lora_b, slots),
                                               silu_and_mul_triton(got), atol=1e-2, rtol=1e-2)
                return max((t.float() - expected.float()).abs().max().item() for t in (got, fused))

            return impls, lora_bytes(x, weight, lora_a, lora_b, slots), check if runner.use_triton else None

        runner.case(f"lora {layer}", f"{case} r{lora_cfg['rank']}", build)


def _silu_impls(out, x, lora_a, lora_b, slots, order) -> dict:
    """gate_up's activation with the adapters: the expand then silu_and_mul, the fused kernel (on rows as they come
    and sorted by slot), and the base's."""
    starts = (0, out.shape[1] // 2)

    def unfused():
        lora_expand_triton(out, lora_shrink_triton(x, lora_a, slots), lora_b, slots, starts)
        return silu_and_mul_triton(out)

    return {"silu unfused": unfused,
            "silu fused": lambda: lora_expand_silu_triton(out, lora_shrink_triton(x, lora_a, slots), lora_b, slots),
            "silu fused sorted": lambda: lora_expand_silu_triton(out, lora_shrink_triton(x, lora_a, slots, order=order),
                                                                 lora_b, slots, order=order),
            "silu base": lambda: silu_and_mul_triton(out)}


def bench_tune_lora(runner, cfg: dict, lora_cfg: dict):
    """The launchers' configs against their defaults (each `... default` row should be the best or near it):
    TUNE_SHRINK on the qkv and down layers, TUNE_EXPAND on every layer from 64 rows on (the expand's bandwidth),
    TUNE_FUSED on every layer up to 16 rows (kernels/lora_fused.py fused_config), TUNE_SILU on gate_up from 64
    rows on (expand_silu_config)."""
    for layer, in_features, widths, rows, prefill, case in _cases(lora_cfg):

        def build(layer=layer, in_features=in_features, widths=widths, rows=rows, prefill=prefill):
            x, weight, lora_a, lora_b, slots, starts = lora_inputs(rows, in_features, widths, lora_cfg, prefill,
                                                                   cfg["dtype"], runner.device)
            out = torch.matmul(x, weight.T)
            y = lora_shrink_triton(x, lora_a, slots)
            impls = {}
            if layer in ("qkv", "down"):
                impls["shrink default"] = lambda: lora_shrink_triton(x, lora_a, slots)
                for c in TUNE_SHRINK:
                    impls["shrink m{BLOCK_M} split{SPLIT_K}".format(**c)] = lambda c=c: lora_shrink_triton(
                        x, lora_a, slots, config=c)
            if rows >= 64:
                impls["expand default"] = lambda: lora_expand_triton(out, y, lora_b, slots, starts)
                for c in TUNE_EXPAND:
                    impls["expand m{BLOCK_M} n{BLOCK_N} w{num_warps}".format(**c)] = lambda c=c: lora_expand_triton(
                        out, y, lora_b, slots, starts, config=c)
            if rows <= 16:
                impls["fused default"] = lambda: lora_fused_triton(out, x, lora_a, lora_b, slots, starts)
                for c in TUNE_FUSED:
                    impls["fused chunks{N_CHUNKS} k{BLOCK_K} w{num_warps}".format(**c)] = (
                        lambda c=c: lora_fused_triton(out, x, lora_a, lora_b, slots, starts, config=c))
            if len(widths) == 2 and rows >= 64:
                impls["silu default"] = lambda: lora_expand_silu_triton(out, y, lora_b, slots)
                for c in TUNE_SILU:
                    impls["silu m{BLOCK_M} n{BLOCK_N} w{num_warps}".format(**c)] = (
                        lambda c=c: lora_expand_silu_triton(out, y, lora_b, slots, config=c))
            return impls, lora_bytes(x, weight, lora_a, lora_b, slots), None

        runner.case(f"tune lora {layer}", case, build)


def print_lora_overhead(results: list[dict]) -> None:
    """Per case: the LoRA kernels' time over the base matmul's (the step's added cost on that projection), two
    launches and fused; for gate_up, the activation with the adapters, unfused and fused, over the base's."""
    times = {(r["kernel"], r["case"], r["impl"]): r["ms"] for r in results if r["kernel"].startswith("lora ")}
    for (kernel, case, impl), ms in times.items():
        base = times.get((kernel, case, "base matmul"))
        if impl == "lora triton" and base:
            with_lora = times.get((kernel, case, "base + lora"), float("nan"))
            fused = times.get((kernel, case, "lora fused"), float("nan"))
            ordered = times.get((kernel, case, "lora sorted"), float("nan"))
            print(f"lora overhead {kernel[5:]:<8} {case:<28} {100 * ms / base:6.1f}% of the base matmul, fused "
                  f"{100 * fused / base:6.1f}%, sorted {100 * ordered / base:6.1f}% (base + lora "
                  f"{with_lora / base:.3f}x)")
        if impl == "silu unfused" and base:
            fused = times.get((kernel, case, "silu fused"), float("nan"))
            ordered = times.get((kernel, case, "silu fused sorted"), float("nan"))
            print(f"lora silu     {kernel[5:]:<8} {case:<28} unfused {1000 * ms:8.1f} us, fused {1000 * fused:8.1f} us "
                  f"({100 * (ms - fused) / base:+6.1f}% of the base matmul saved), fused sorted "
                  f"{1000 * ordered:8.1f} us")
