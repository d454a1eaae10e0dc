"""Benchmarks of the Triton kernels against torch, with achieved bandwidth / FLOP rate against the H200's ceilings.

    python -m benchmarks.kernels --output-json kernels.json            # on a GPU (about 2-3 minutes on an H200)
    python -m benchmarks.kernels --check                               # verify each kernel against its ref first
    python -m benchmarks.kernels --smoke                               # CPU, tiny sizes, torch references only
    python -m benchmarks.kernels --only int4 --cuda-graph --output-json int4.json   # int4 linears (kernels_int.py)
    python -m benchmarks.kernels --only mla --cuda-graph --output-json mla.json     # DeepSeek's MLA (kernels_mla.py)
    python -m benchmarks.kernels --only lora --cuda-graph --check --output-json lora.json   # LoRA (kernels_lora.py)

Decode attention is memory-bound: it is scored by the K/V bytes it must read over its time, against the
4.3 TB/s copy ceiling. Its K/V is read cold, as in a model, where the other layers' weights pass through the
50 MB L2 between two reads of a layer's cache: a case smaller than COLD_BYTES cycles through copies of its inputs
(under --cuda-graph, which flushes nothing), and a plain read of the same bytes ("read only") shows what any
kernel can reach at that size. Prefill attention is scored in causal FLOPs (2 * 2 * T * T / 2 * heads * head_dim)
against 790 TFLOP/s of dense bf16. The elementwise kernels are scored in bytes read + written, the decode-sized
linear (`--only linear`) in weight bytes read, against cuBLAS on the same weights; the fused MoE (`--only moe`,
benchmarks/kernels_moe.py) in routed expert bytes or FLOPs, against the torch reference, and over AWQ / FP8 experts
(`--only moe-quant`, benchmarks/kernels_moe_quant.py) against it in bf16; the int4 linears (`--only
int4`, benchmarks/kernels_int.py) in weight bytes and FLOPs both, against bf16 cuBLAS; the batched LoRA shrink +
expand (`--only lora`, benchmarks/kernels_lora.py) in the bytes it moves, and as overhead over the base layer's
matmul. Torch's
scaled_dot_product_attention on the same data laid out contiguously, and the torch references, are the
baselines. Each case is independent: a failure (out of memory, a mismatch under --check) is printed and
recorded, and the run goes on.
"""

import argparse
import functools
import itertools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/kernels.py`: this file must not shadow `kernels`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.nn.functional as F

from benchmarks.kernels_fp8 import bench_fp8, bench_tune_fp8, bench_tune_fp8_kv_decode
from benchmarks.kernels_int import INT_LAYOUTS, INT_MODELS, SMOKE_INT_MODELS, bench_int4, bench_tune_int4
from benchmarks.kernels_lora import GPU_LORA, SMOKE_LORA, bench_lora, bench_tune_lora, print_lora_overhead
from benchmarks.kernels_mla import GPU_MLA, SMOKE_MLA, bench_mla
from benchmarks.kernels_moe import GPU_MOE_SHAPES, SMOKE_MOE, bench_moe, bench_tune_moe
from benchmarks.kernels_moe_quant import bench_moe_quant
from kernels._triton import cdiv, tl, triton
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.kv_cache import write_kv_cache_triton
from kernels.linear import linear_cublas, linear_ref, linear_triton
from kernels.paged_attention import (
    decode_num_splits,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
    paged_attention_prefill_ref,
    paged_attention_prefill_triton,
)
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels.rotary import compute_cos_sin_cache, rotary_embedding_ref, rotary_embedding_triton

COPY_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 790e12
MAX_DECODE_TOKENS = 2**21  # batch * context: 8 GB of bf16 K/V for Llama-3-8B's 8 x 128 KV heads
COLD_BYTES = 256 * 2**20  # decode cases cycle through input copies of at least this many bytes: 5x the L2

GPU = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, hidden=4096,
           inter=14336, decode_batches=[1, 8, 64, 256], decode_contexts=[512, 2048, 8192, 16384, 32768],
           prefill_tokens=[512, 1024, 2048, 4096, 8192], elementwise_tokens=[1, 256, 4096, 16384],
           linear_rows=[1, 2, 4, 8, 16])
SMOKE = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, hidden=256,
             inter=512, decode_batches=[1, 4], decode_contexts=[64, 256], prefill_tokens=[64, 128],
             elementwise_tokens=[1, 16], linear_rows=[1])


USE_CUDA_GRAPH = False  # --cuda-graph: time replays of a captured graph (no host launch cost, as in the engine)


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds per call: triton's do_bench (L2 flushed before every call) on a GPU, a clock on CPU.
    Small launches are host-bound under do_bench; --cuda-graph times them as the engine runs them (a function marked
    `eager`, one with data-dependent shapes that no graph can capture, is timed without)."""
    if device.type == "cuda":
        import triton.testing

        torch.cuda.synchronize()  # do_bench_cudagraph runs fn on a new stream, which would not wait for the inputs
        if USE_CUDA_GRAPH and not getattr(fn, "eager", False):
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def max_error(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """The largest |out - ref|; raises if any element is off by more than tol * (1 + |ref|) or is NaN."""
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    if out.isnan().any() or (err > tol * (1 + ref.abs())).any():
        raise AssertionError(f"mismatch: max error {err.nan_to_num(float('inf')).max().item():.3g} (tol {tol})")
    return err.max().item()


class Runner:
    """Runs cases, prints a row per measurement as it comes, keeps results and failures for the JSON."""

    def __init__(self, device: torch.device, check: bool, use_triton: bool):
        self.device, self.check, self.use_triton = device, check, use_triton
        self.results, self.failures = [], []
        print(f"{'kernel':<16} {'case':<24} {'impl':<21} {'time':>10} {'achieved':>15} {'of ceiling':>10}")

    def case(self, kernel: str, case: str, build):
        """build() -> (impls {name: fn}, work {"bytes" or "flops": n}, check fn or None). Never raises.

        The first impl is the baseline the others are compared with. A failing impl is recorded and skipped.
        """
        try:
            impls, work, check = build()
            if self.check and check is not None:
                print(f"{kernel:<16} {case:<24} check: max error {check():.3g}")
        except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
            self._fail(kernel, case, "", exc)
            return
        baseline = None
        for impl, fn in impls.items():
            try:
                ms = time_ms(fn, self.device)
            except Exception as exc:  # noqa: BLE001
                self._fail(kernel, case, impl, exc)
                continue
            self._record(kernel, case, impl, ms, work, baseline)
            baseline = baseline or (impl, ms)
        del impls, check
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fail(self, kernel, case, impl, exc):
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"{kernel:<16} {case:<24} {impl:<21} FAILED {message}")
        if not isinstance(exc, (AssertionError, torch.cuda.OutOfMemoryError)):
            traceback.print_exc(limit=3)
        self.failures.append(dict(kernel=kernel, case=case, impl=impl, error=message))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _record(self, kernel, case, impl, ms, work, baseline):
        # work["impl_bytes"]: the bytes of impls that read other data than the rest (a bf16 weight beside int4)
        work = {k: v for k, v in work.items() if k != "impl_bytes"} | (
            {"bytes": work["impl_bytes"][impl]} if impl in work.get("impl_bytes", {}) else {})
        if "fp8_flops" in work:  # FP8 tensor cores: twice the bf16 rate
            rate, ceiling, unit = work["fp8_flops"] / (ms * 1e-3), 2 * BF16_FLOPS_PER_S, "TFLOP/s"
        elif "bytes" in work:  # with "flops" too, both are reported: bandwidth first
            rate, ceiling, unit = work["bytes"] / (ms * 1e-3), COPY_BYTES_PER_S, "GB/s"
        else:
            rate, ceiling, unit = work["flops"] / (ms * 1e-3), BF16_FLOPS_PER_S, "TFLOP/s"
        scaled = rate / (1e12 if unit == "TFLOP/s" else 1e9)
        row = dict(kernel=kernel, case=case, impl=impl, ms=ms, unit=unit, achieved=scaled,
                   fraction_of_ceiling=rate / ceiling, **work)
        flop_rate = ""
        if unit == "GB/s" and "flops" in work:
            row |= dict(tflop_per_s=work["flops"] / (ms * 1e-3) / 1e12,
                        fraction_of_bf16_peak=work["flops"] / (ms * 1e-3) / BF16_FLOPS_PER_S)
            flop_rate = f" {row['tflop_per_s']:>7.1f} TFLOP/s {100 * row['fraction_of_bf16_peak']:>5.1f}%"
        self.results.append(row)
        vs = f"  ({baseline[1] / ms:.2f}x {baseline[0]})" if baseline else ""
        print(f"{kernel:<16} {case:<24} {impl:<21} {ms * 1e3:>8.1f}us {scaled:>9.1f} {unit:<7}"
              f"{100 * rate / ceiling:>8.1f}%{flop_rate}{vs}")


def paged_kv(num_tokens_per_seq: int, num_seqs: int, cfg: dict, device: torch.device):
    """Random K/V for num_seqs sequences in shuffled blocks; also the contiguous [B, Hkv, L, D] copies."""
    block_size, kv_heads, dim = cfg["block_size"], cfg["num_kv_heads"], cfg["head_dim"]
    blocks_per_seq = -(-num_tokens_per_seq // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=cfg["dtype"], device=device)
    v_cache = torch.randn(shape, dtype=cfg["dtype"], device=device)
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).int()

    def dense(cache):
        return cache[tables.long()].flatten(1, 2)[:, :num_tokens_per_seq].transpose(1, 2).contiguous()

    return k_cache, v_cache, tables, dense(k_cache), dense(v_cache)


@triton.jit
def _read_kernel(k_ptr, v_offset, out_ptr, n, per_program, BLOCK: tl.constexpr):
    """Sums n elements at k_ptr (the first half of the programs) and at k_ptr + v_offset (the second half)."""
    half = tl.num_programs(0) // 2
    pid = tl.program_id(0)
    base = k_ptr + (pid // half).to(tl.int64) * v_offset
    start = (pid % half).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(start, start + per_program, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_only(k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """One launch that reads both caches and nothing else: the floor of a decode kernel's time at their size.
    1024 programs of 8 warps, 2048-element tiles: the fastest of a sweep on an H200 at 8k and 16k tokens."""
    n, block = k_cache.numel(), 2048
    per_program = cdiv(cdiv(n, out.numel() // 2), block) * block
    v_offset = (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size()  # one base pointer reads both
    _read_kernel[(out.numel(),)](k_cache, v_offset, out, n, per_program, BLOCK=block, num_warps=8, num_stages=3)


def cold_kv(batch: int, ctx: int, cfg: dict, device: torch.device) -> tuple[list[tuple], int]:
    """A decode case's paged K/V (`paged_kv`) in as many copies as a timed run cycles through for each call to read
    them from memory (one on CPU), and the K/V bytes of one copy."""
    kv_bytes = 2 * cfg["dtype"].itemsize * batch * ctx * cfg["num_kv_heads"] * cfg["head_dim"]
    copies = cdiv(COLD_BYTES, kv_bytes) if device.type == "cuda" else 1
    return [paged_kv(ctx, batch, cfg, device) for _ in range(copies)], kv_bytes


def check_merges(args: tuple, ref: torch.Tensor) -> float:
    """Both decode merges (fused: the last split merges; or a second kernel) against the reference (`ref`, for
    args' query), for two queries in a row: the second call must find the fused merge's arrival counters zeroed
    again (a merge left undone leaves the output wrong). Raises on a mismatch, as max_error does."""
    error = 0.0
    second = (torch.randn_like(args[0]), *args[1:])
    for call, expected in ((args, ref), (second, paged_attention_decode_ref(*second))):
        for fused in (True, False):
            try:
                error = max(error, max_error(paged_attention_decode_triton(*call, fused_merge=fused), expected, 2e-2))
            except AssertionError as exc:
                raise AssertionError(f"{'fused merge' if fused else 'merge kernel'}: {exc}") from None
    return error


def bench_decode(runner: Runner, cfg: dict):
    device, heads, dim = runner.device, cfg["num_heads"], cfg["head_dim"]
    scale = 1 / math.sqrt(dim)
    for batch in cfg["decode_batches"]:
        for ctx in cfg["decode_contexts"]:
            if batch * ctx > MAX_DECODE_TOKENS:
                continue

            def build(batch=batch, ctx=ctx):
                copies, kv_bytes = cold_kv(batch, ctx, cfg, device)
                turn = itertools.cycle(copies)  # each timed call takes the next copy (a CUDA graph captures many)
                k_cache, v_cache, tables, _, _ = copies[0]
                q = torch.randn(batch, heads, dim, dtype=cfg["dtype"], device=device)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
                args = (q, k_cache, v_cache, tables, lens, scale)

                def sdpa():
                    _, _, _, k_dense, v_dense = next(turn)
                    return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, scale=scale,
                                                          enable_gqa=True)

                def triton_decode(**kw):
                    k, v, t, _, _ = next(turn)
                    return paged_attention_decode_triton(q, k, v, t, lens, scale, **kw)

                impls = {"torch sdpa": sdpa}
                if runner.use_triton:
                    impls["triton"] = triton_decode
                    splits = decode_num_splits(batch, cfg["num_kv_heads"], tables.shape[1] * cfg["block_size"], device)
                    if splits > 1:
                        impls["triton split=1"] = lambda: triton_decode(num_splits=1)
                    sums = torch.empty(1024, dtype=torch.float32, device=device)
                    impls["read only"] = lambda: read_only(*next(turn)[:2], sums)
                else:
                    impls["torch ref"] = lambda: paged_attention_decode_ref(*args)
                work = dict(bytes=kv_bytes + 2 * q.numel() * q.element_size())

                def check():
                    ref = paged_attention_decode_ref(*args)
                    if not runner.use_triton:
                        return max_error(F.scaled_dot_product_attention(
                            q[:, :, None], *copies[0][3:], scale=scale, enable_gqa=True)[:, :, 0], ref, 2e-2)
                    error = max_error(paged_attention_decode_triton(*args), ref, 2e-2)
                    return max(error, check_merges(args, ref)) if splits > 1 else error

                return impls, work, check

            runner.case("decode attn", f"batch {batch} ctx {ctx}", build)


def bench_prefill(runner: Runner, cfg: dict):
    device, heads, dim = runner.device, cfg["num_heads"], cfg["head_dim"]
    scale = 1 / math.sqrt(dim)
    for tokens in cfg["prefill_tokens"]:

        def build(tokens=tokens):
            k_cache, v_cache, tables, k_dense, v_dense = paged_kv(tokens, 1, cfg, device)
            q = torch.randn(tokens, heads, dim, dtype=cfg["dtype"], device=device)
            starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
            lens = torch.tensor([tokens], dtype=torch.int32, device=device)
            args = (q, k_cache, v_cache, tables, starts, lens, scale)
            q_dense = q.transpose(0, 1)[None]  # [1, H, T, D]
            group = heads // cfg["num_kv_heads"]  # repeat K/V outside the timing: sdpa then runs flash attention
            k_rep, v_rep = k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)
            impls = {"torch sdpa": lambda: F.scaled_dot_product_attention(q_dense, k_rep, v_rep, is_causal=True,
                                                                          scale=scale)}
            if runner.use_triton:
                impls["triton"] = lambda: paged_attention_prefill_triton(*args, max_query_len=tokens)
            else:
                impls["torch ref"] = lambda: paged_attention_prefill_ref(*args)

            def check():
                ref = paged_attention_prefill_ref(*args)
                out = (paged_attention_prefill_triton(*args, max_query_len=tokens) if runner.use_triton
                       else impls["torch sdpa"]()[0].transpose(0, 1))
                return max_error(out, ref, 2e-2)

            return impls, dict(flops=2 * tokens * tokens * heads * dim), check

        runner.case("prefill attn", f"{tokens} tokens", build)


def write_kv_cache_scatter(k, v, k_cache, v_cache, slot_mapping) -> None:
    """The torch baseline of the KV write when every slot is valid: one index_copy_ per cache. Unlike
    write_kv_cache_ref (a boolean mask for the -1 slots) it can be captured in a CUDA graph."""
    slots = slot_mapping.long()
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def elementwise_case(runner: Runner, kernel: str, case: str, triton_fn, ref_fn, make_args, num_bytes: int):
    """One elementwise case. make_args() makes fresh inputs: in-place kernels (rotary, KV write) get their own."""

    def build():
        args = make_args()
        impls = {"torch ref": lambda: ref_fn(*args)}
        if runner.use_triton:
            impls["triton"] = lambda: triton_fn(*args)

        def check():
            a, b = make_args(), make_args()
            out, ref = triton_fn(*a), ref_fn(*b)
            if out is None:  # in place: compare the tensors it wrote
                out, ref = a, b
            out, ref = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
            pairs = [(x, y) for x, y in zip(out, ref) if isinstance(x, torch.Tensor) and x.is_floating_point()]
            return max(max_error(x, y, 2e-2) for x, y in pairs)

        return impls, dict(bytes=num_bytes), check if runner.use_triton else None

    runner.case(kernel, case, build)


def bench_elementwise(runner: Runner, cfg: dict):
    device, dtype, hidden, inter = runner.device, cfg["dtype"], cfg["hidden"], cfg["inter"]
    heads, kv_heads, dim, block_size = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["block_size"]
    size = torch.tensor([], dtype=dtype).element_size()

    def randn(*shape):
        return torch.randn(shape, dtype=dtype, device=device)

    cos_sin = compute_cos_sin_cache(dim, 32768, 500000.0).to(device)
    for tokens in cfg["elementwise_tokens"]:
        norm_inputs = (randn(tokens, hidden), randn(hidden), 1e-5, randn(tokens, hidden))
        elementwise_case(runner, "rms_norm+resid", f"T {tokens} x {hidden}", rms_norm_triton, rms_norm_ref,
                         lambda a=norm_inputs: a, 4 * tokens * hidden * size + hidden * size)

        positions = torch.randint(0, cos_sin.shape[0], (tokens,), device=device)
        q, k = randn(tokens, heads * dim), randn(tokens, kv_heads * dim)
        elementwise_case(runner, "rotary", f"T {tokens} q {heads}x{dim}", rotary_embedding_triton,
                         rotary_embedding_ref, lambda p=positions, q=q, k=k: (p, q.clone(), k.clone(), cos_sin, dim),
                         2 * tokens * (heads + kv_heads) * dim * size + tokens * (dim * 4 + 8))

        gate_up = randn(tokens, 2 * inter)
        elementwise_case(runner, "silu_and_mul", f"T {tokens} x {inter}", silu_and_mul_triton, silu_and_mul_ref,
                         lambda x=gate_up: (x,), 3 * tokens * inter * size)

        new_k, new_v = randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
        num_blocks = -(-2 * tokens // block_size)
        slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]

        def kv_args(k=new_k, v=new_v, slots=slots, num_blocks=num_blocks):
            caches = [torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype, device=device) for _ in "kv"]
            return k, v, *caches, slots

        elementwise_case(runner, "write_kv_cache", f"T {tokens} kv {kv_heads}x{dim}", write_kv_cache_triton,
                         write_kv_cache_scatter, kv_args, 4 * tokens * kv_heads * dim * size + tokens * 8)


LINEAR_COPIES = 8  # weights per timed call, each used once: 270 MB and more, past the 50 MB L2 (as in a model)
# --tune: the decode-sized linear's launch settings, at batch 1 and 4
LINEAR_TUNE_CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=st)
                       for n in (16, 32, 64) for k in (128, 256, 512) for st in (3, 4)]


def llama_linears(cfg: dict) -> dict:
    """A Llama layer's projections: name -> (weight rows, in features, gated)."""
    hidden, heads, kv_heads, dim = cfg["hidden"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    return {"qkv": ((heads + 2 * kv_heads) * dim, hidden, False), "o": (hidden, heads * dim, False),
            "gate_up+silu": (2 * cfg["inter"], hidden, True), "down": (hidden, cfg["inter"], False)}


def linear_case(runner: Runner, kernel: str, rows: int, cfg: dict, ops: list[str], configs: dict):
    """Times `ops` in order over LINEAR_COPIES layers' weights, each op on its own fixed input: cuBLAS (with
    silu_and_mul after gate_up), then the Triton kernel with each of `configs` (None: the default settings)."""
    device, dtype = runner.device, cfg["dtype"]
    shapes = llama_linears(cfg)

    def build():
        layers = [{op: torch.randn(shapes[op][:2], dtype=dtype, device=device) * shapes[op][1] ** -0.5 for op in ops}
                  for _ in range(LINEAR_COPIES)]
        x = {op: torch.randn(rows, shapes[op][1], dtype=dtype, device=device) for op in ops}

        def chain(fn):
            def run():
                for layer in layers:
                    for op, w in layer.items():
                        fn(x[op], w, gated=shapes[op][2])
            return run

        impls = {"cuBLAS": chain(linear_cublas)}
        if runner.use_triton:
            for name, c in configs.items():
                impls[name] = chain(functools.partial(linear_triton, config=c))

        def check():
            return max(max_error(linear_triton(x[op], w, gated=shapes[op][2], config=c),
                                 linear_ref(x[op], w, gated=shapes[op][2]), 2e-2)
                       for op, w in layers[0].items() for c in configs.values())

        num_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
        return impls, dict(bytes=num_bytes), check if runner.use_triton else None

    runner.case(kernel, f"rows {rows} {'+'.join(o.split('+')[0] for o in ops)}", build)


def bench_linear(runner: Runner, cfg: dict):
    """A layer's four projections in a chain at decode batch sizes: the Triton kernel (default launch settings)
    against cuBLAS, reading the same weight bytes."""
    for rows in cfg["linear_rows"]:
        linear_case(runner, "linear layer", rows, cfg, list(llama_linears(cfg)), {"triton": None})


def bench_tune_linear(runner: Runner, cfg: dict):
    """Each projection alone against LINEAR_TUNE_CONFIGS: kernels/linear.py's default_config should be the best."""
    for rows in (1, 4):
        configs = {"default": None}
        configs.update({"n{BLOCK_N} k{BLOCK_K} w{num_warps} st{num_stages}".format(**c): c
                        for c in LINEAR_TUNE_CONFIGS})
        for op in llama_linears(cfg):
            linear_case(runner, "tune linear", rows, cfg, [op], configs)


DECODE_TUNE_CASES = [(1, 8192), (1, 16384), (1, 32768), (8, 8192), (64, 8192), (256, 2048)]
# The tile configs that were competitive in the full sweep (benchmarks/results/h200-kernels-tune-decode.txt): n64 w4
# st5 (the default with few programs), n64 w4 st3 (the default with many), n128 w4 st3 (best at 8k).
DECODE_TUNE_CONFIGS = [dict(block_n=n, num_warps=w, num_stages=st)
                       for n, w, st in [(64, 4, 5), (64, 4, 3), (128, 4, 3)]]
# Batch 1: the power-of-two default (32), the programs wanted for two per SM on an H200 (132 x 2 / 8 KV heads = 33),
# and twice each.
DECODE_TUNE_SPLITS_BATCH_1 = [32, 33, 64, 66]
PREFILL_TUNE_CASES = [2048, 4096, 8192]
PREFILL_TUNE_CONFIGS = [
    dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
    for m, n, w, st in [(128, 64, 8, 5), (128, 64, 8, 3), (256, 64, 16, 2), (256, 64, 16, 4), (256, 128, 16, 2),
                        (256, 32, 16, 3), (256, 64, 8, 3), (512, 64, 16, 2)]
]


def bench_tune_decode(runner: Runner, cfg: dict):
    """Sweep decode's merges, split counts and tile configs at a few sizes: the defaults in kernels/paged_attention.py
    (decode_config, decode_num_splits) should be the best rows. Each case times the default (where it splits, the
    fused merge: the last split merges) and, where it splits, the merge in a second kernel; batch 1 also both merges at
    DECODE_TUNE_SPLITS_BATCH_1 x DECODE_TUNE_CONFIGS, and cases the default does not split both at 2 splits.
    About 90 s on an H200."""
    device, heads, dim = runner.device, cfg["num_heads"], cfg["head_dim"]
    scale = 1 / math.sqrt(dim)
    for batch, ctx in DECODE_TUNE_CASES:

        def build(batch=batch, ctx=ctx):
            copies, kv_bytes = cold_kv(batch, ctx, cfg, device)
            turn = itertools.cycle([c[:3] for c in copies])  # paged K/V only, cold as in bench_decode
            q = torch.randn(batch, heads, dim, dtype=cfg["dtype"], device=device)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)

            def decode(**kw):
                return paged_attention_decode_triton(q, *next(turn), lens, scale, **kw)

            default = decode_num_splits(batch, cfg["num_kv_heads"], ctx, device)
            impls = {"default": decode}
            if default > 1:
                impls["merge kernel"] = lambda: decode(fused_merge=False)
            if batch == 1:
                variants = [(s, c) for s in DECODE_TUNE_SPLITS_BATCH_1 for c in DECODE_TUNE_CONFIGS]
            else:
                variants = [(2, None)] if default == 1 else []
            for splits, c in variants:
                tiles = " n{block_n} w{num_warps} st{num_stages}".format(**c) if c else ""
                for fused in (False, True):
                    name = f"{'fused ' if fused else ''}s{splits}{tiles}"
                    impls[name] = lambda c=c, s=splits, f=fused: decode(num_splits=s, config=c, fused_merge=f)
            return impls, dict(bytes=kv_bytes), None

        runner.case("tune decode", f"batch {batch} ctx {ctx}", build)


def bench_tune_prefill(runner: Runner, cfg: dict):
    """Sweep prefill's tile configs at a few sizes: prefill_config's choice should be the best row."""
    device, heads, dim = runner.device, cfg["num_heads"], cfg["head_dim"]
    scale = 1 / math.sqrt(dim)
    for tokens in PREFILL_TUNE_CASES:

        def build(tokens=tokens):
            k_cache, v_cache, tables, _, _ = paged_kv(tokens, 1, cfg, device)
            q = torch.randn(tokens, heads, dim, dtype=cfg["dtype"], device=device)
            starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
            lens = torch.tensor([tokens], dtype=torch.int32, device=device)
            args = (q, k_cache, v_cache, tables, starts, lens, scale)
            impls = {"default": lambda: paged_attention_prefill_triton(*args, max_query_len=tokens)}
            for c in PREFILL_TUNE_CONFIGS:
                name = "m{block_m} n{block_n} w{num_warps} s{num_stages}".format(**c)
                impls[name] = lambda c=c: paged_attention_prefill_triton(*args, max_query_len=tokens, config=c)
            return impls, dict(flops=2 * tokens * tokens * heads * dim), None

        runner.case("tune prefill", f"{tokens} tokens", build)


LONG_CONTEXT = 32768  # the top of the 512-32k range
TARGETS = [  # (label, kernel, which cases, fraction of the ceiling the issue asks for)
    ("decode attn, long context (32k)", "decode attn", lambda case: int(case.split("ctx ")[1]) >= LONG_CONTEXT, 0.80),
    ("prefill attn, >= 4k tokens", "prefill attn", lambda case: int(case.split()[0]) >= 4096, 0.50),
    ("elementwise, T >= 4096", None, lambda case: int(case.split()[1]) >= 4096, 0.70),
    ("fp8 decode-sized linear, 1-16 rows", "fp8 linear", lambda case: True, 0.88),
]
OPT_IN_GROUPS = ("int4", "moe-quant", "mla", "lora", "fp8-kv")  # run when --only names them (int4: ~2 more minutes)
NOT_ELEMENTWISE = ("decode attn", "prefill attn", "linear layer", "tune linear", "moe", "tune moe", "moe quant",
                   "fp8 linear", "fp8 gemm", "fp8 kv decode", "tune fp8 linear", "mla decode", "mla prefill")


def print_targets(results: list[dict]) -> None:
    """The Triton kernels' worst case in each group the targets speak of, against the target; then decode's cases
    under 32k at batch 1, against a plain read of the same bytes (no target: there fixed latencies weigh)."""
    for label, kernel, in_scope, target in TARGETS:
        rows = [r for r in results if r["impl"] in ("triton", "fp8 triton")
                and (r["kernel"] == kernel if kernel else r["kernel"] not in NOT_ELEMENTWISE)
                and in_scope(r["case"])]
        if rows:
            worst = min(rows, key=lambda r: r["fraction_of_ceiling"])
            verdict = "ok" if worst["fraction_of_ceiling"] >= target else "BELOW TARGET"
            print(f"target {label}: worst {100 * worst['fraction_of_ceiling']:.0f}% ({worst['kernel']}, "
                  f"{worst['case']}) vs {100 * target:.0f}%: {verdict}")
    decode = {(r["case"], r["impl"]): r["fraction_of_ceiling"] for r in results if r["kernel"] == "decode attn"}
    for (case, impl), fraction in decode.items():
        if impl == "triton" and case.startswith("batch 1 ") and (case, "read only") in decode:
            print(f"decode attn {case}: {100 * fraction:.0f}%; torch sdpa "
                  f"{100 * decode.get((case, 'torch sdpa'), float('nan')):.0f}%, "
                  f"read only {100 * decode[(case, 'read only')]:.0f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, help="write every measurement and failure here")
    parser.add_argument("--check", action="store_true", help="verify each kernel against its ref before timing")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, torch references only")
    parser.add_argument("--only", choices=["decode", "prefill", "elementwise", "linear", "moe", "moe-quant", "fp8",
                                           "fp8-kv", "int4", "mla", "lora"],
                        action="append",
                        help="run only these groups (repeatable); int4, moe-quant, mla and lora run only when named")
    parser.add_argument("--moe-shape", choices=list(GPU_MOE_SHAPES), default="mixtral-8x7b",
                        help="--only moe / moe-quant: the experts' shape (Mixtral's 8 x 14336 x 4096, top 2, or "
                             "Qwen3-30B-A3B's 128 x 768 x 2048, top 8)")
    parser.add_argument("--mla-heads", type=int, default=None,
                        help="--only mla: heads a rank (default 16, DeepSeek-V2-Lite's; 128 is V2's at tp 1)")
    parser.add_argument("--int-layouts", nargs="+", choices=list(INT_LAYOUTS), default=["awq"],
                        help="--only int4: the packed layouts to time (AWQ, GPTQ symmetric, GPTQ act-order; group "
                             "128; GPTQ with groups of 32, and GGUF Q4_K as served: groups of 32, scales and mins)")
    parser.add_argument("--int-rows", type=int, nargs="+", default=None,
                        help="--only int4: the row counts to time (default 1-2048: every path's crossing)")
    parser.add_argument("--tune", action="store_true",
                        help="instead, sweep the attention kernels' tile configs and split counts (GPU, a few minutes; "
                        "--only decode / prefill / linear / moe / fp8 / fp8-kv / lora / int4)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time graph replays (no host launch overhead, as in the engine's decode graphs)")
    args = parser.parse_args(argv)
    global USE_CUDA_GRAPH
    USE_CUDA_GRAPH = args.cuda_graph

    if args.smoke:
        device, cfg = torch.device("cpu"), SMOKE
    elif torch.cuda.is_available():
        device, cfg = torch.device("cuda"), GPU
    else:
        parser.error("no CUDA GPU: use --smoke for the CPU smoke test")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; ceilings: copy {COPY_BYTES_PER_S / 1e12:.1f} TB/s, "
          f"bf16 {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s")
    torch.manual_seed(0)
    runner = Runner(device, check=args.check, use_triton=device.type == "cuda")
    moe_cfg = SMOKE_MOE if args.smoke else GPU_MOE_SHAPES[args.moe_shape]
    lora_cfg = SMOKE_LORA if args.smoke else GPU_LORA
    groups = {"decode": bench_decode, "prefill": bench_prefill, "elementwise": bench_elementwise,
              "linear": bench_linear, "moe": lambda runner, cfg: bench_moe(runner, cfg, moe_cfg), "fp8": bench_fp8,
              "moe-quant": lambda runner, cfg: bench_moe_quant(runner, cfg, moe_cfg),
              "int4": lambda runner, cfg: bench_int4(runner, SMOKE_INT_MODELS if args.smoke else INT_MODELS,
                                                     args.int_layouts, args.int_rows),
              "mla": lambda runner, cfg: bench_mla(runner, cfg, (SMOKE_MLA if args.smoke else GPU_MLA)
                                                   | ({"heads": args.mla_heads} if args.mla_heads else {})),
              "lora": lambda runner, cfg: bench_lora(runner, cfg, lora_cfg)}
    if args.tune:
        if device.type != "cuda":
            parser.error("--tune needs a GPU")
        groups = {"decode": bench_tune_decode, "prefill": bench_tune_prefill, "linear": bench_tune_linear,
                  "moe": lambda runner, cfg: bench_tune_moe(runner, cfg, moe_cfg), "fp8": bench_tune_fp8,
                  "fp8-kv": bench_tune_fp8_kv_decode,
                  "lora": lambda runner, cfg: bench_tune_lora(runner, cfg, lora_cfg),
                  "int4": lambda runner, cfg: bench_tune_int4(runner, INT_MODELS, args.int_layouts,
                                                          args.int_rows)}
    start = time.perf_counter()
    for group, bench in groups.items():
        if (not args.only and group not in OPT_IN_GROUPS) or group in (args.only or ()):
            try:
                bench(runner, cfg)
            except Exception as exc:  # noqa: BLE001 - setup outside a case failed: report it, go on
                runner._fail(group, "(setup)", "", exc)
    elapsed = time.perf_counter() - start
    print(f"{len(runner.results)} measurements, {len(runner.failures)} failures in {elapsed:.0f} s")
    print_targets(runner.results)
    print_lora_overhead(runner.results)
    for failure in runner.failures:
        print(f"FAILED {failure['kernel']} / {failure['case']} {failure['impl']}: {failure['error']}")
    if args.output_json:
        args.output_json.write_text(json.dumps(dict(
            device=name, smoke=args.smoke, checked=args.check, elapsed_s=elapsed,
            ceilings=dict(copy_bytes_per_s=COPY_BYTES_PER_S, bf16_flops_per_s=BF16_FLOPS_PER_S),
            results=runner.results, failures=runner.failures), indent=1))
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
