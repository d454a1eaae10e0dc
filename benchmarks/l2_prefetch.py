"""`python -m benchmarks.l2_prefetch [OUT.json]` (a GPU): does prefetching a decode GEMM's weight into the L2, on a
second stream while the small kernels before it run, make the GEMM faster at batch 1?

Per layer (8 layers with weights of their own: more than the L2 holds): GAP pairs of small elementwise kernels,
then the batch-1 GEMM (the FP8 swap kernel, or bf16 cuBLAS), all captured in one CUDA graph and replayed after a
256 MB write that evicts the L2. Variants: no prefetch; a Triton kernel loading the weight (evict_last); a
`prefetch.global.L2` a cache line; each issued on a side stream at the gap's start, and the GEMM either waiting for
it (join) or not. Prints microseconds a layer (the median of 20 replays)."""
import json
import sys

import torch

from kernels._triton import tl, triton
from kernels.fp8 import quantize_per_token, quantize_weight
from kernels.linear_fp8 import linear_fp8_swap


@triton.jit
def _load_prefetch(ptr, dummy, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    s = tl.sum(v, 0)
    tl.store(dummy, s, mask=s == 0x7FFFFFF1)


@triton.jit
def _asm_prefetch(ptr, n_lines, LINES: tl.constexpr):
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    p = ptr + lines.to(tl.int64) * 32  # int32 elements: 128 B a line
    p = tl.where(lines < n_lines, p, ptr)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


def prefetch(kind, w, dummy):
    flat = w.view(torch.int32).reshape(-1)
    n = flat.numel()
    if kind == "load":
        _load_prefetch[(triton.cdiv(n, 4096),)](flat, dummy, n, BLOCK=4096, num_warps=4)
    elif kind == "asm":
        lines = n // 32
        _asm_prefetch[(triton.cdiv(lines, 1024),)](flat, lines, LINES=1024, num_warps=4)


def run(shape, dtype, kind, gap, join_before_gemm, layers=8, reps=20):
    n, k = shape
    dev = "cuda"
    ws, scales = [], []
    for _ in range(layers):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        if dtype == "fp8":
            wq, s = quantize_weight(w)
            ws.append(wq)
            scales.append(s)
        else:
            ws.append(w)
            scales.append(None)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    small = torch.randn(1, 4096, device=dev)
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()
    xq, xs = quantize_per_token(x)

    def gemm(i):
        if dtype == "fp8":
            return linear_fp8_swap(xq, xs, ws[i], scales[i])
        return torch.nn.functional.linear(x, ws[i])

    def step():
        outs = []
        for i in range(layers):
            if kind != "none":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    prefetch(kind, ws[i], dummy)
            t = small
            for _ in range(gap):
                t = t * 1.0001 + 0.5
            if kind != "none" and join_before_gemm:
                torch.cuda.current_stream().wait_stream(side)
            outs.append(gemm(i))
        if kind != "none":
            torch.cuda.current_stream().wait_stream(side)
        return outs
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
    times = []
    for _ in range(reps):
        flush.add_(1)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / layers)
    times.sort()
    return times[len(times) // 2]


def main(out_path=None):
    rows = []
    for dtype in ("fp8", "bf16"):
        for name, shape in (("o", (4096, 4096)), ("qkv", (6144, 4096)), ("down", (4096, 14336))):
            for gap in (0, 3):
                for kind in ("none", "load", "asm"):
                    for join in ((False, True) if kind != "none" else (False,)):
                        us = run(shape, dtype, kind, gap, join)
                        rows.append(dict(dtype=dtype, layer=name, gap=gap, prefetch=kind, join=join, us=us))
                        print(f"{dtype:5s} {name:5s} gap {gap} {kind:5s} join {join!s:5s} {us:8.1f} us/layer",
                              flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
