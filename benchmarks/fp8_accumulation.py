"""How the FP8 decode kernel's accumulation compares with float32: `python -m benchmarks.fp8_accumulation
[--output-json F]` (an H200: benchmarks/results/h200-fp8-accumulation.json).

Hopper's FP8 MMA keeps fewer bits than float32 in its accumulator; the swap kernel (kernels/linear_fp8.py) promotes
its partial sums into float32 every PROMOTE_K products (`swap_config`). For each PROMOTE_K, on Llama-3-8B's four
projections in bf16 at 1 and 16 rows: the largest fraction over the layers of outputs that round otherwise than
`linear_fp8_ref` (dequantized operands, float32 F.linear), the largest |out - ref| / max |ref|, and the time summed
over the four (triton.testing.do_bench, no CUDA graph: the latency benchmark is the one to compare speeds with).
cuBLASLt's `_scaled_mm` (linear_fp8 from 17 rows) beside it, on a GPU. `--small`: small shapes, also on a CPU under
TRITON_INTERPRET=1 (no times; the interpreter rounds float32 to bf16 otherwise than a GPU, so its fractions are not
the hardware's).

`--fast-accum` (a GPU) instead times cuBLASLt's GEMM with `use_fast_accum` off and on (kernels/linear_fp8.py
`FAST_ACCUM`) at Llama-3-8B's four projections and 256-8,192 rows: microseconds (triton's do_bench_cudagraph, the
median), TFLOP/s, and the error against float32 math on the same e4m3 values (largest and mean, each over the
output's largest / mean magnitude): benchmarks/results/h100-fp8-fast-accum-gemms.json (made by this mode's first
version, the median of 15 replays of a CUDA graph of 10 GEMMs).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import device_name, write_json
from benchmarks.kernels import llama_linears
from kernels.fp8 import quantize_per_token, quantize_weight
from kernels.linear_fp8 import linear_fp8_ref, linear_fp8_scaled_mm, linear_fp8_swap

LLAMA3_8B = {"hidden": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "inter": 14336}
SMALL = {"hidden": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "inter": 512}
PROMOTE = (512, 256, 128, 64, 32)


def _layer(rows: int, out_rows: int, in_features: int, device, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w_q, w_scale = quantize_weight(torch.randn(out_rows, in_features, generator=gen) * in_features ** -0.5)
    x = (3 * torch.randn(rows, in_features, generator=gen)).to(torch.bfloat16)
    return dict(x=x.to(device), weight=w_q.to(device), weight_scale=w_scale.to(device))


def _compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return ((out != ref).float().mean().item(),
            ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item())


def run(cfg: dict, device: torch.device) -> list[dict]:
    timed = device.type == "cuda"
    layers = {rows: [(_layer(rows, n, k, device), gated) for n, k, gated in llama_linears(cfg).values()]
              for rows in (1, 16, 17, 256)}
    results = []
    for promote in PROMOTE:
        for rows in (1, 16):
            mismatch, rel_err, ms = 0.0, 0.0, 0.0
            for layer, gated in layers[rows]:
                x_q, x_scale = quantize_per_token(layer["x"])

                def swap(layer=layer, gated=gated, x_q=x_q, x_scale=x_scale, promote=promote):
                    return linear_fp8_swap(x_q, x_scale, layer["weight"], layer["weight_scale"], gated=gated,
                                           config={"PROMOTE_K": promote})

                m, e = _compare(swap(), linear_fp8_ref(**layer, gated=gated))
                mismatch, rel_err = max(mismatch, m), max(rel_err, e)
                if timed:
                    import triton

                    ms += triton.testing.do_bench(swap, warmup=20, rep=100)
            results.append(dict(promote=promote, rows=rows, mismatch=mismatch, rel_err=rel_err,
                                ms=ms if timed else None))
            print(results[-1], flush=True)
    if timed:  # _scaled_mm is cuBLASLt's: a GPU only
        for rows in (17, 256):
            mismatch = max(_compare(linear_fp8_scaled_mm(layer["x"], layer["weight"], layer["weight_scale"],
                                                         gated=gated), linear_fp8_ref(**layer, gated=gated))[0]
                           for layer, gated in layers[rows])
            results.append(dict(impl="scaled_mm", rows=rows, mismatch=mismatch))
            print(results[-1], flush=True)
    return results


def fast_accum(cfg: dict) -> list[dict]:
    """torch._scaled_mm (rowwise scales) with use_fast_accum off and on, per projection and row count."""
    import triton.testing

    torch.manual_seed(0)
    results = []
    for name, (n, k, _) in llama_linears(cfg).items():
        w_q, w_scale = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        for rows in (256, 512, 1024, 4096, 8192):
            x_q, x_scale = quantize_per_token(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
            ref = (x_q.float() * x_scale[:, None]) @ (w_q.float() * w_scale[:, None]).t()
            row: dict = {"layer": name, "rows": rows}
            for fast in (False, True):
                def gemm(fast=fast, x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale):
                    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale[:, None].contiguous(),
                                            scale_b=w_scale[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast)

                error = (gemm().float() - ref).abs()
                torch.cuda.synchronize()  # do_bench_cudagraph runs gemm on a new stream, which would not wait
                us = 1e3 * triton.testing.do_bench_cudagraph(gemm, rep=40, return_mode="median")
                row |= {f"us_fast{int(fast)}": us, f"tflops_fast{int(fast)}": 2 * rows * n * k / us / 1e6,
                        f"maxerr_fast{int(fast)}": (error.max() / ref.abs().max()).item(),
                        f"meanerr_fast{int(fast)}": (error.mean() / ref.abs().mean()).item()}
            row["speedup"] = row["us_fast0"] / row["us_fast1"]
            results.append(row)
            print(row, flush=True)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small shapes (a CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--fast-accum", action="store_true", help="cuBLASLt's use_fast_accum off / on (a GPU)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = fast_accum(LLAMA3_8B) if args.fast_accum else run(SMALL if args.small else LLAMA3_8B, device)
    result = {"benchmark": "fp8-accumulation", "device": device_name(), "results": rows}
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
