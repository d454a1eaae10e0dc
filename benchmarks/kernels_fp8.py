"""`python -m benchmarks.kernels --only fp8`: the FP8 kernels against their bf16 counterparts (Llama-3-8B shapes).

    fp8 linear, 1-16 rows   a layer's four projections, the weights read cold (LINEAR_COPIES layers): bf16 cuBLAS,
                            the bf16 decode-sized Triton kernel, the FP8 one. Bandwidth counts the FP8 weight bytes
                            (the bf16 rows read twice as many): the FP8 kernel's target is 88-90% of copy.
    fp8 gemm, 32-8192 rows  the same four projections as GEMMs, in FP8 FLOPs against 2 x the bf16 ceiling: bf16
                            cuBLAS, the FP8 Triton GEMM quantizing x in its prologue, quantize_per_token + the
                            Triton GEMM, quantize_per_token + torch._scaled_mm, and _scaled_mm alone (x already
                            FP8: what the quantization pass costs). linear_fp8 takes _scaled_mm from
                            kernels/linear_fp8.py's SCALED_MM_MIN_ROWS on: set it where the rows cross.
    fp8 kv decode           decode attention over an e4m3 pool against the bf16 pool, in bytes of the FP8 K/V.
    --tune                  the decode-sized launch settings (`default_config`) against a sweep.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from kernels.activation import silu_and_mul
from kernels.fp8 import FP8_DTYPE, quantize_per_token, quantize_weight
from kernels.linear import linear_cublas, linear_triton
from kernels.linear_fp8 import linear_fp8_ref, linear_fp8_scaled_mm, linear_fp8_swap, linear_fp8_triton
from kernels.paged_attention import paged_attention_decode_ref, paged_attention_decode_triton

FP8_ROWS = [1, 2, 4, 8, 16]
GEMM_ROWS = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
KV_CASES = [(1, 8192), (1, 32768), (8, 8192), (64, 2048), (256, 2048)]
SWAP_CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, SPLIT_K=1)
                for n, w in ((64, 4), (128, 8), (128, 4)) for k in (256, 512) for st in (3, 4)]
# Split-K (kernels/linear_fp8.py auto_split_k): more programs for the layers of fewer 64-row tiles than SMs.
SWAP_CONFIGS += [dict(BLOCK_N=64, BLOCK_K=k, num_warps=4, num_stages=4, SPLIT_K=split)
                 for k in (256, 512) for split in (2, "auto")]
TUNE_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st)
                for n in (32, 64) for k in (256, 512, 1024) for w in (4, 8) for st in (2, 3, 4)]


def _layers(cfg: dict, copies: int, device) -> list[dict]:
    """`copies` layers of (bf16 weight, fp8 weight, fp8 scales) for each projection, and whether it is gated."""
    from benchmarks.kernels import llama_linears

    out = []
    for _ in range(copies):
        layer = {}
        for op, (rows, cols, gated) in llama_linears(cfg).items():
            w = torch.randn(rows, cols, dtype=torch.bfloat16, device=device) * cols ** -0.5
            layer[op] = (w, *quantize_weight(w), gated)
        out.append(layer)
    return out


def _chain(layers, x, fn):
    def run():
        for layer in layers:
            for op, (w, w_q, w_scale, gated) in layer.items():
                fn(x[op], w, w_q, w_scale, gated)
    return run


def _check(layers, x, fns) -> float:
    from benchmarks.kernels import max_error

    error = 0.0
    for op, (w, w_q, w_scale, gated) in layers[0].items():
        ref = linear_fp8_ref(x[op], w_q, w_scale, gated=gated)
        for fn in fns:
            out = fn(x[op], w, w_q, w_scale, gated)
            error = max(error, max_error(out, ref, 3e-2 * ref.abs().max().item()))
    return error


def decode_impls() -> dict:
    """linear_fp8's decode-sized choices (kernels/linear_fp8.py DECODE_IMPL) and cuBLASLt's, as (x, w, q, s, g) -> y."""
    def quant_triton(x, w, q, s, g):
        x_q, x_s = quantize_per_token(x)
        return linear_fp8_triton(x_q, q, s, gated=g, x_scale=x_s)

    def quant_swap(x, w, q, s, g, config=None):
        x_q, x_s = quantize_per_token(x)
        return linear_fp8_swap(x_q, x_s, q, s, gated=g, config=config)

    impls = {"fp8 fused": lambda x, w, q, s, g: linear_fp8_triton(x, q, s, gated=g),
             "fp8 quant+triton": quant_triton, "fp8 quant+swap": quant_swap,
             "fp8 quant+scaled_mm": lambda x, w, q, s, g: linear_fp8_scaled_mm(x, q, s, gated=g)}
    for c in SWAP_CONFIGS:
        name = "fp8 swap n{BLOCK_N} k{BLOCK_K} w{num_warps} st{num_stages}".format(**c)
        name += f" split {c['SPLIT_K']}" if c["SPLIT_K"] != 1 else ""
        impls[name] = functools.partial(lambda x, w, q, s, g, c: quant_swap(x, w, q, s, g, c), c=c)
    return impls


def fp8_linear_case(runner, cfg: dict, rows: int, impls: dict, kernel: str = "fp8 linear"):
    from benchmarks.kernels import LINEAR_COPIES, llama_linears

    device = runner.device

    def build():
        layers = _layers(cfg, LINEAR_COPIES, device)
        x = {op: torch.randn(rows, cols, dtype=torch.bfloat16, device=device)
             for op, (_, cols, _) in llama_linears(cfg).items()}
        timed = {"bf16 cuBLAS": _chain(layers, x, lambda x, w, q, s, g: linear_cublas(x, w, gated=g)),
                 "bf16 triton": _chain(layers, x, lambda x, w, q, s, g: linear_triton(x, w, gated=g))}
        for name, fn in impls.items():  # each checked on its own: one wrong impl is reported, the rest timed
            try:
                if runner.check:
                    print(f"{kernel:<16} rows {rows:<19} {name}: max error {_check(layers, x, [fn]):.3g}")
                timed[name] = _chain(layers, x, fn)
            except Exception as exc:  # noqa: BLE001
                runner._fail(kernel, f"rows {rows}", name, exc)
        num_bytes = sum(w_q.numel() for layer in layers for _, w_q, _, _ in layer.values())
        return timed, dict(bytes=num_bytes), None

    runner.case(kernel, f"rows {rows}", build)


def _gemm_impls(layers, x):
    def fused(x, w, q, s, g):
        return linear_fp8_triton(x, q, s, gated=g)

    def quant_triton(x, w, q, s, g):
        x_q, x_s = quantize_per_token(x)
        out = linear_fp8_triton(x_q, q, s, gated=g, x_scale=x_s)
        return out

    def scaled_mm(x, w, q, s, g):
        return linear_fp8_scaled_mm(x, q, s, gated=g)

    x_q = {op: quantize_per_token(t) for op, t in x.items()}

    def scaled_mm_only():
        for layer in layers:
            for op, (_, q, s, gated) in layer.items():
                out = torch._scaled_mm(x_q[op][0], q.t(), scale_a=x_q[op][1][:, None], scale_b=s[None, :],
                                       out_dtype=torch.bfloat16)
                if gated:
                    silu_and_mul(out)

    impls = {"bf16 cuBLAS": _chain(layers, x, lambda x, w, q, s, g: linear_cublas(x, w, gated=g)),
             "fp8 triton fused-q": _chain(layers, x, fused), "fp8 quant+triton": _chain(layers, x, quant_triton),
             "fp8 quant+scaled_mm": _chain(layers, x, scaled_mm), "fp8 scaled_mm only": scaled_mm_only}
    return impls, [fused, scaled_mm]


def bench_fp8_gemm(runner, cfg: dict):
    from benchmarks.kernels import llama_linears

    device = runner.device
    for rows in GEMM_ROWS:

        def build(rows=rows):
            layers = _layers(cfg, 2, device)
            x = {op: torch.randn(rows, cols, dtype=torch.bfloat16, device=device)
                 for op, (_, cols, _) in llama_linears(cfg).items()}
            impls, fns = _gemm_impls(layers, x)
            flops = sum(2 * rows * w.shape[0] * w.shape[1] for layer in layers for w, _, _, _ in layer.values())
            return impls, dict(fp8_flops=flops), lambda: _check(layers, x, fns)

        runner.case("fp8 gemm", f"rows {rows}", build)


def bench_fp8_kv_decode(runner, cfg: dict):
    from benchmarks.kernels import cold_kv, max_error

    device, heads, dim = runner.device, cfg["num_heads"], cfg["head_dim"]
    scale = 1 / math.sqrt(dim)
    kv_heads = cfg["num_kv_heads"]
    for batch, ctx in KV_CASES:

        def build(batch=batch, ctx=ctx):
            copies, kv_bytes = cold_kv(batch, ctx, cfg, device)
            fp8 = [(k.to(FP8_DTYPE), v.to(FP8_DTYPE), t) for k, v, t, _, _ in copies]
            k_scale = v_scale = torch.ones(kv_heads, device=device)
            bf16_turn, fp8_turn = itertools.cycle([c[:3] for c in copies]), itertools.cycle(fp8)
            q = torch.randn(batch, heads, dim, dtype=cfg["dtype"], device=device)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            impls = {"bf16 triton": lambda: paged_attention_decode_triton(q, *next(bf16_turn), lens, scale),
                     "fp8 triton": lambda: paged_attention_decode_triton(q, *next(fp8_turn), lens, scale,
                                                                         k_scale=k_scale, v_scale=v_scale)}

            def check():
                args = (q, *fp8[0], lens, scale)
                ref = paged_attention_decode_ref(*args, k_scale=k_scale, v_scale=v_scale)
                return max_error(paged_attention_decode_triton(*args, k_scale=k_scale, v_scale=v_scale), ref, 2e-2)

            return impls, dict(bytes=kv_bytes // 2), check

        runner.case("fp8 kv decode", f"batch {batch} ctx {ctx}", build)


def bench_fp8(runner, cfg: dict):
    if not runner.use_triton:
        return  # CPU smoke: nothing here runs without a GPU (torch._scaled_mm, fp8 tensor cores)
    for rows in FP8_ROWS:
        fp8_linear_case(runner, cfg, rows, decode_impls())
    bench_fp8_gemm(runner, cfg)
    bench_fp8_kv_decode(runner, cfg)


# FP8 KV decode: tile configs, each with bfloat16 and float16 dots (decode_config's "f16_dots")
# The short contexts are a 128-in / 128-out workload's decode batches (4,096 x 128/128 at 256-1,024 sequences); 256 to
# 512 keys where 64-key tiles stop winning; 1k-4k keys a 2,048-in / 2,048-out workload's.
FP8_KV_TUNE_CASES = [(8, 8192), (64, 2048), (256, 2048), (256, 128), (512, 192), (1024, 192), (512, 256), (512, 384),
                     (512, 512), (512, 1024), (512, 3072), (256, 4096)]
FP8_KV_TUNE_CONFIGS = [dict(block_n=n, num_warps=w, num_stages=st)
                       for n, w, st in [(64, 4, 3), (64, 4, 5), (128, 4, 3), (128, 8, 3), (64, 8, 3), (32, 4, 3),
                                        (128, 4, 2), (64, 4, 2), (32, 4, 2), (16, 4, 2)]]


def bench_tune_fp8_kv_decode(runner, cfg: dict):
    """Decode attention over an e4m3 pool: the default, then each config with both dot types; in bytes of FP8 K/V."""
    from benchmarks.kernels import cold_kv

    device, heads, dim = runner.device, cfg["num_heads"], cfg["head_dim"]
    scale = 1 / math.sqrt(dim)
    kv_scale = torch.ones(cfg["num_kv_heads"], device=device)
    for batch, ctx in FP8_KV_TUNE_CASES:

        def build(batch=batch, ctx=ctx):
            copies, kv_bytes = cold_kv(batch, ctx, cfg, device)
            turn = itertools.cycle([(k.to(FP8_DTYPE), v.to(FP8_DTYPE), t) for k, v, t, _, _ in copies])
            bf16_turn = itertools.cycle([c[:3] for c in copies])
            q = torch.randn(batch, heads, dim, dtype=cfg["dtype"], device=device)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)

            def decode(config=None):
                return paged_attention_decode_triton(q, *next(turn), lens, scale, config=config, k_scale=kv_scale,
                                                     v_scale=kv_scale)

            impls = {"default": decode, "bf16 pool default": lambda: paged_attention_decode_triton(
                q, *next(bf16_turn), lens, scale)}
            for c in FP8_KV_TUNE_CONFIGS:
                for f16 in (False, True) if ctx > 256 else (True,):  # short contexts: the default's f16 dots only
                    name = "n{block_n} w{num_warps} st{num_stages}".format(**c) + (" f16" if f16 else " bf16")
                    impls[name] = lambda c=c, f16=f16: decode({**c, "f16_dots": f16})
            return impls, dict(bytes=kv_bytes // 2), None

        runner.case("tune fp8 kv decode", f"batch {batch} ctx {ctx}", build)


def bench_tune_fp8(runner, cfg: dict):
    configs = {"default": None}
    configs.update({"n{BLOCK_N} k{BLOCK_K} w{num_warps} st{num_stages}".format(**c): c for c in TUNE_CONFIGS})
    impls = {name: functools.partial(lambda x, w, q, s, g, c: linear_fp8_triton(x, q, s, gated=g, config=c), c=c)
             for name, c in configs.items()}
    for rows in (1, 8, 16):
        fp8_linear_case(runner, cfg, rows, impls, "tune fp8 linear")
    bench_tune_fp8_kv_decode(runner, cfg)
