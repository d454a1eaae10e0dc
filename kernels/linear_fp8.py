"""FP8 linear layers: e4m3 weights with float32 scales, activations quantized per token (kernels/fp8.py).

    linear_fp8(x, w_q, w_scale)          y = dequant(quant(x)) @ dequant(w_q).T (+ bias), in x's dtype
    linear_fp8(..., gated=True)          silu(gate) * up of such a [gate ; up] output (the Llama MLP)

    x_scale, input_scale   dynamic: each row's power-of-two scale (computed here, or x comes as `QuantizedRows`
                           from the kernel that computed it: RMSNorm, SiLU-and-mul); static: one power-of-two
                           scale for every row (`input_scale`, from a checkpoint)
    quantize_output        gated: the SiLU-and-mul output as QuantizedRows, for the FP8 layer that reads it
    w_scale                [N] per output row, or [ceil(N / bn), ceil(K / bk)] per block (`block_size`)

On a GPU, by batch size (per-row weight scales; block-scaled checkpoints and float32 x take the Triton GEMM
kernel at every size):

    decode-sized (<= MAX_ROWS rows)   x quantized (quantize_per_token, unless it came as QuantizedRows), then
                                      _fp8_linear_swap_kernel: the weight tile is the MMA's
                                      tall side (64 rows, a Hopper wgmma's height) and x's few rows its narrow one,
                                      so x is not padded to 64 rows; streams the weight bytes, SiLU-and-mul fused
    larger (prefill, big batches)     x quantized as above, then cuBLASLt's `torch._scaled_mm` (rowwise scales)

The H200 measurements that chose them (benchmarks/results/h200-kernels-fp8.json, `python -m benchmarks.kernels
--only fp8`): at 1-16 rows the swap kernel reads 8 Llama-3-8B layers' weights in 0.60-0.62 ms (65-67% of copy
bandwidth) against 0.89 ms for the bf16 decode kernel and 1.14-1.24 ms for _fp8_linear_kernel quantizing x in its
loop (its 16-row tiles compile to mma.sync on f16, each FP8 weight converted first; the swap kernel's to FP8
wgmma m64n16k32: tests/kernels/test_kernel_compile.py reads the PTX); from 32 rows _scaled_mm beat the Triton
GEMM at every size (e.g. 256 rows: 0.30 ms against 0.46 with x quantized first, 1.29 quantizing in the prologue).
_fp8_linear_kernel stays for block scales, float32 x (its PRECISE dot) and as `DECODE_IMPL`
"fused" / "quant".
"""

import functools

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    is_interpreting,
    num_sms,
    pdl_options,
    shared_memory_per_block,
    split_counts,
    tl,
    triton,
    use_triton,
    wait_for_prior,
)
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.fp8 import (
    FP8_DTYPE,
    QuantizedRows,
    dequantize_weight,
    pow2_scales,
    to_e4m3,
)
from kernels.linear import store_output, store_split_k_slice

MAX_ROWS = 16  # the decode-sized launch settings up to this many rows
# From here on (per-row weight scales on a GPU): quantize_per_token + torch._scaled_mm. On the H200 it beat the
# Triton GEMM at every size measured, 32 to 8,192 rows (benchmarks/results/h200-kernels-fp8.json).
SCALED_MM_MIN_ROWS = MAX_ROWS + 1
# Decode-sized layers with per-row weight scales: "fused" (_fp8_linear_kernel quantizing x in its loop), "quant"
# (quantize_per_token, then that kernel on e4m3 x), "swap" (quantize_per_token, then _fp8_linear_swap_kernel),
# "scaled_mm" (as larger batches).
DECODE_IMPL = "swap"  # measured on the H200: benchmarks/results/h200-kernels-fp8.json
# torch._scaled_mm's use_fast_accum (cuBLASLt's FP8 fast accumulation, as TensorRT-LLM and vLLM's CUTLASS kernels
# run it): Hopper's FP8 MMA keeps its partial sums in its own accumulator across the K loop rather than promoting
# them into float32 every few MMAs (torch's default). On an H100 (2026-12-06, Llama-3-8B's projections,
# benchmarks/results/h100-fp8-fast-accum-gemms.json) 1.02-1.21x faster at 256-8,192 rows, the mean error against
# float32 math on the same e4m3 values 1.8e-3 of the mean output (2.8e-3 for down's K of 14,336) against 1.4e-3;
# the 8B FP8 128 / 128 run 23,398 -> 24,903 output tok/s (h100-throughput-llama3-8b-fp8-fast-accum-{off,on}.json).
FAST_ACCUM = True


@triton.jit
def _fp8_dot(a, b, PRECISE: tl.constexpr, PROMOTE_K: tl.constexpr):
    """a @ b of e4m3 tiles, float32: multiplied in float32 when PRECISE (the products of FP8 values are exact
    there), else by Hopper's FP8 MMA, whose accumulator keeps fewer bits than float32: its partial sums are
    promoted into a float32 one every PROMOTE_K products."""
    if PRECISE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, max_num_imprecise_acc=PROMOTE_K)
    return out


@triton.jit
def _fp8_linear_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
    stride_x, stride_w, stride_o, stride_ws, up_row,
    X_MODE: tl.constexpr, W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, EXACT: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """X_MODE 0: x is e4m3 with scales [M]; 1: x is float, quantized per row here; 2: float, one scale [1].
    W_BLOCK_N = 0: per-row weight scales [N]; else block scales [N / W_BLOCK_N, K / W_BLOCK_K] (BLOCK_K divides
    W_BLOCK_K, so a K tile lies in one scale block). PRECISE (the interpreter, float32 x): the FP8 values multiplied
    in float32 (their products are exact there) rather than by Hopper's FP8 MMA, whose accumulation is imprecise."""
    wait_for_prior(PDL)
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)  # GROUP_M row tiles side by side share each weight tile in L2
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N

    if X_MODE == 1:  # dynamic: each row's largest |x| first
        amax = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & (cols < K)[None, :],
                         other=0.0)
            amax = tl.maximum(amax, tl.abs(xv.to(tl.float32)))
        x_scale, x_inv = pow2_scales(tl.max(amax, 1), 8)  # ACTIVATION_EXP (a kernel reads no Python globals)
    elif X_MODE == 2:
        x_scale = tl.load(x_scale_ptr + rows * 0)
        x_inv = (254 << 23) - x_scale.to(tl.int32, bitcast=True)  # 1 / a power of two, from its exponent bits
        x_inv = x_inv.to(tl.float32, bitcast=True)
    else:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=1.0)
        x_inv = x_scale  # unused

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        xv = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & k_mask[None, :],
                     other=0.0)
        if X_MODE != 0:
            xv = to_e4m3(xv.to(tl.float32) * x_inv[:, None], EXACT)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + cols[None, :], mask=w_mask, other=0.0)
        part = _fp8_dot(xv, tl.trans(w), PRECISE, BLOCK_K)
        if W_BLOCK_N != 0:
            part *= tl.load(w_scale_ptr + (offs_n // W_BLOCK_N) * stride_ws + k0 // W_BLOCK_K, mask=n_mask,
                            other=0.0)[None, :]
        acc += part
        if GATED:
            up_n = up_row + offs_n
            w_up = tl.load(w_ptr + up_n[:, None] * stride_w + cols[None, :], mask=w_mask, other=0.0)
            part = _fp8_dot(xv, tl.trans(w_up), PRECISE, BLOCK_K)
            if W_BLOCK_N != 0:
                part *= tl.load(w_scale_ptr + (up_n // W_BLOCK_N) * stride_ws + k0 // W_BLOCK_K, mask=n_mask,
                                other=0.0)[None, :]
            acc_up += part

    acc = acc * x_scale[:, None]
    acc_up = acc_up * x_scale[:, None]
    if W_BLOCK_N == 0:
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(w_scale_ptr + up_row + offs_n, mask=n_mask, other=0.0)[None, :]
    store_output(acc, acc_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_row, HAS_BIAS, GATED)


@triton.jit
def _fp8_linear_swap_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_w,
    stride_o, up_row,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EXACT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE_K: tl.constexpr, PDL: tl.constexpr,
):
    """Decode-sized, x already e4m3 with row scales [M], per-row weight scales: the weight tile is the MMA's tall
    side (BLOCK_N = 64 rows a warp group, Hopper's wgmma height) and x's few rows its narrow side (BLOCK_M = 16), so
    x is not padded to 64 rows and both operands stay FP8 (K-major, as FP8 wgmma wants them). SPLIT_K > 1: program
    (n, s) takes the s-th of SPLIT_K slices of K, and the last of a tile's programs to finish adds the slices up
    (`store_split_k_slice`): more programs for a layer of few 64-row tiles (fewer tiles than SMs)."""
    wait_for_prior(PDL)
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    per_slice = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = tl.program_id(1) * per_slice
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(K, k_begin + per_slice), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        xv = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & k_mask[None, :],
                     other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + cols[None, :], mask=w_mask, other=0.0)
        acc += _fp8_dot(w, tl.trans(xv), EXACT, PROMOTE_K)
        if GATED:
            w_up = tl.load(w_ptr + (up_row + offs_n)[:, None] * stride_w + cols[None, :], mask=w_mask, other=0.0)
            acc_up += _fp8_dot(w_up, tl.trans(xv), EXACT, PROMOTE_K)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=1.0)
    out = tl.trans(acc) * x_scale[:, None] * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    out_up = out
    if GATED:
        out_up = (tl.trans(acc_up) * x_scale[:, None]
                  * tl.load(w_scale_ptr + up_row + offs_n, mask=n_mask, other=0.0)[None, :])
    if SPLIT_K == 1:
        store_output(out, out_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_row, HAS_BIAS,
                     GATED)
    else:
        tile = rows[:, None] * N + offs_n[None, :]
        if store_split_k_slice(out, out_up, part_ptr, count_ptr, tile, n_mask[None, :], BLOCK_M * N, GATED,
                               SPLIT_K):
            out, out_up = _slices_sum(part_ptr, tile, n_mask, BLOCK_M * N, GATED, SPLIT_K, BLOCK_M, BLOCK_N)
            store_output(out, out_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_row, HAS_BIAS,
                         GATED)


@triton.jit
def _slices_sum(part_ptr, tile, n_mask, slot, GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The tile's SPLIT_K slices added in slice order (the same result whichever program is last), read from L2."""
    out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    out_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        base = part_ptr + split * 2 * slot
        out += tl.load(base + tile, mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
        if GATED:
            out_up += tl.load(base + slot + tile, mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
    return out, out_up


def _check_inputs(x, weight, weight_scale, bias, gated, block_size, input_scale, x_scale=None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [T, K] and weight [N, K] must agree, got {tuple(x.shape)} and {tuple(weight.shape)}")
    check_dtype("weight", weight, (FP8_DTYPE,))
    if x_scale is None:
        check_dtype("x", x, FLOAT_DTYPES)
    elif x.dtype != FP8_DTYPE or x_scale.shape != (x.shape[0],):
        raise ValueError(f"a quantized x must be e4m3 with x_scale [{x.shape[0]}], got {x.dtype} and "
                         f"{tuple(x_scale.shape)}")
    n, k = weight.shape
    expected = (n,) if block_size is None else (cdiv(n, block_size[0]), cdiv(k, block_size[1]))
    if tuple(weight_scale.shape) != expected or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 {expected}, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale must hold one value, got shape {tuple(input_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if gated and (n % 2 or (block_size is not None and (n // 2) % block_size[0])):
        raise ValueError(f"a gated weight stacks gate and up rows: an even row count (whole scale blocks each), "
                         f"got {n}")


def _launch_output(x, weight, gated: bool, out_dtype, *others) -> torch.Tensor:
    """A launcher's checks that its tensors can go to a kernel (others: the optional ones, None where absent), and
    its output [T, N] (N / 2 when gated)."""
    check_launchable(x, weight, *[t for t in others if t is not None])
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    return torch.empty(x.shape[0], out_features, dtype=out_dtype, device=x.device)


@functools.lru_cache(maxsize=None)
def default_config(num_rows: int, out_features: int, gated: bool, block_k: int | None, x_itemsize: int,
                   device: torch.device) -> dict:
    """Launch settings. Decode-sized: kernels/linear.py's recipe (one program per SM streaming a wide tile, BLOCK_N
    the widest that still gives programs for ~70% of the SMs) with K tiles twice as long (an FP8 tile of the same
    bytes; half that for float32 x), 8 warps, shrunk until the stages fit in shared memory; `--tune --only fp8`
    sweeps them. GEMM: 128 x 128 x 128 tiles (64 rows for short batches, 64 columns when gated: two weight
    tiles)."""
    if num_rows <= MAX_ROWS:
        sms = num_sms(device)
        block_n = next((n for n in (64, 32) if cdiv(out_features, n) >= 0.7 * sms), 16)
        tile_k = (512 if gated or block_n == 64 else 1024) // (2 if x_itemsize == 4 else 1)
        # 8 warps: x's tile is quantized in registers; with 4 the 16 x 1024 tiles spill (compile_sm90.py).
        cfg = {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": tile_k, "num_warps": 8,
               "num_stages": 3 if gated else 4}
    else:
        cfg = {"BLOCK_M": 64 if num_rows <= 64 else 128, "BLOCK_N": 64 if gated else 128, "BLOCK_K": 128,
               "num_warps": 4 if num_rows <= 64 else 8, "num_stages": 3}
    if block_k is not None:  # a K tile must lie inside one scale block
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 1 << (block_k.bit_length() - 1))
        if block_k % cfg["BLOCK_K"]:
            raise ValueError(f"weight block size {block_k} along K must be a power of two or a multiple of 128")
    limit = shared_memory_per_block(device)

    def shared_bytes() -> int:  # the pipelined tiles, and float32 x's precise dot stages its operands in float32
        row_bytes = cfg["BLOCK_M"] * x_itemsize + cfg["BLOCK_N"] * (2 if gated else 1)
        tiles = cfg["num_stages"] * cfg["BLOCK_K"] * row_bytes
        return tiles + (cfg["BLOCK_K"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * 4 if x_itemsize == 4 else 0)

    while shared_bytes() > limit and (cfg["num_stages"] > 2 or cfg["BLOCK_K"] > 32):
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        else:
            cfg["BLOCK_K"] //= 2
    return cfg


def linear_fp8_triton(x, weight, weight_scale, bias=None, gated=False, block_size=None, input_scale=None,
                      x_scale=None, config: dict | None = None, out_dtype=None):
    """Triton launcher of `linear_fp8` (any number of rows). x_scale: x is already e4m3 with these row scales
    (out_dtype: the result's, bf16 by default then)."""
    _check_inputs(x, weight, weight_scale, bias, gated, block_size, input_scale, x_scale)
    out_dtype = out_dtype or (torch.bfloat16 if x_scale is not None else x.dtype)  # float32: the PRECISE dot
    out = _launch_output(x, weight, gated, out_dtype, weight_scale, bias, input_scale, x_scale)
    (num_rows, in_features), out_features = x.shape, out.shape[1]
    if out.numel() == 0:
        return out
    cfg = {**default_config(num_rows, out_features, gated, block_size[1] if block_size else None, x.dtype.itemsize,
                            x.device), **(config or {})}
    mode = 0 if x_scale is not None else 2 if input_scale is not None else 1
    grid = (cdiv(num_rows, cfg["BLOCK_M"]) * cdiv(out_features, cfg["BLOCK_N"]),)
    _fp8_linear_kernel[grid](
        x, x_scale if mode == 0 else input_scale if mode == 2 else weight_scale, weight, weight_scale,
        bias if bias is not None else weight_scale, out, num_rows, out_features, in_features,
        x.stride(0), weight.stride(0), out.stride(0), weight_scale.stride(0), out_features,
        X_MODE=mode, W_BLOCK_N=block_size[0] if block_size else 0, W_BLOCK_K=block_size[1] if block_size else 0,
        HAS_BIAS=bias is not None, GATED=gated, EXACT=is_interpreting(),
        PRECISE=is_interpreting() or out_dtype == torch.float32, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg.get("GROUP_M", 8),
        **pdl_options(x.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def linear_fp8_ref(x, weight, weight_scale, bias=None, gated=False, block_size=None, input_scale=None):
    """Torch reference of `linear_fp8` (and its CPU implementation): quantize x, dequantize both, F.linear in
    float32; the result in x's dtype, then silu_and_mul's reference when gated."""
    if isinstance(x, QuantizedRows):
        _check_inputs(x.values, weight, weight_scale, bias, gated, block_size, None, x.scale)
    else:
        _check_inputs(x, weight, weight_scale, bias, gated, block_size, input_scale)
    rows = _quantize_input(x, input_scale, reference=True)
    w_deq = dequantize_weight(weight, weight_scale, block_size)
    out = torch.nn.functional.linear(rows.dequantize(), w_deq, None if bias is None else bias.float())
    out = out.to(rows.dtype)
    return silu_and_mul_ref(out) if gated else out


def linear_fp8_scaled_mm(x, weight, weight_scale, bias=None, gated=False, input_scale=None, quantize_output=False):
    """`linear_fp8` for prefill-sized batches with per-row weight scales: quantize_per_token (one pass, unless x
    is QuantizedRows already), then torch._scaled_mm (cuBLASLt, rowwise scales on Hopper), then silu_and_mul when
    gated (quantizing its output in the same kernel when asked)."""
    rows = _quantize_input(x, input_scale)
    out = torch._scaled_mm(rows.values, weight.t(), scale_a=rows.scale[:, None].contiguous(),
                           scale_b=weight_scale[None, :], out_dtype=rows.dtype, use_fast_accum=FAST_ACCUM)
    if bias is not None:  # added here: not every cuBLASLt rowwise-scaled kernel takes a bias
        out += bias
    return silu_and_mul(out, quantize_output) if gated else out


def swap_config(gated: bool) -> dict:
    """Launch settings of _fp8_linear_swap_kernel: one warp group per 64 weight rows, K tiles of 512 bytes, 4
    stages (the launcher halves the K tile where the stages do not fit: gated layers). The best of the sweep in
    benchmarks/kernels_fp8.py (SWAP_CONFIGS) on the H200. SPLIT_K: 1, or "auto" (`auto_split_k`), which measured
    1-2% slower on the H200 (benchmarks/results/h200-kernels-fp8.json). PROMOTE_K: the FP8 MMA's partial sums go
    into float32 once per K tile; every 128 or 32 products brought the bf16 outputs closer to the float32
    reference (11% / 4% rounding otherwise, against 15%) but cost 14% / 18% of 8B decode at batch 1
    (benchmarks/results/h200-fp8-accumulation.json), for errors far below e4m3's own."""
    return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 512, "num_warps": 4, "num_stages": 4, "SPLIT_K": 1,
            "PROMOTE_K": 512}


def auto_split_k(num_tiles: int, in_features: int, block_k: int, num_sms: int) -> int:
    """Slices of K for a layer of fewer tiles than ~90% of the SMs (Llama-3-8B's o and down projections: 64 tiles
    of 64 rows on 132 SMs), each slice at least two K tiles long; else 1."""
    split = round(0.9 * num_sms / num_tiles) if num_tiles < 0.75 * num_sms else 1
    return max(1, min(split, 4, in_features // (2 * block_k)))


def linear_fp8_swap(x_q, x_scale, weight, weight_scale, bias=None, gated=False, out_dtype=torch.bfloat16,
                    config: dict | None = None):
    """Decode-sized (<= MAX_ROWS rows) `linear_fp8` of e4m3 x with row scales, per-row weight scales: the Triton
    launcher of _fp8_linear_swap_kernel."""
    _check_inputs(x_q, weight, weight_scale, bias, gated, None, None, x_scale)
    if x_q.shape[0] > MAX_ROWS:
        raise ValueError(f"x must have at most {MAX_ROWS} rows here, got {x_q.shape[0]}")
    out = _launch_output(x_q, weight, gated, out_dtype, x_scale, weight_scale, bias)
    (num_rows, in_features), out_features = x_q.shape, out.shape[1]
    if out.numel() == 0:
        return out
    cfg = swap_config(gated) | (config or {})
    limit = shared_memory_per_block(x_q.device)
    while cfg["num_stages"] * cfg["BLOCK_K"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"] * (2 if gated else 1)) > limit:
        cfg["BLOCK_K"] //= 2  # shrink to fit, as default_config does
    num_tiles = cdiv(out_features, cfg["BLOCK_N"])
    split = cfg.get("SPLIT_K", 1)
    if split == "auto":
        split = auto_split_k(num_tiles, in_features, cfg["BLOCK_K"], num_sms(x_q.device))
    counts = split_counts(x_q.device, num_tiles) if split > 1 else None
    if counts is None:
        split = 1
    parts = torch.empty(split, 2, cfg["BLOCK_M"], out_features, dtype=torch.float32, device=x_q.device) \
        if split > 1 else out
    _fp8_linear_swap_kernel[(num_tiles, split)](
        x_q, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, parts,
        counts if counts is not None else x_scale, num_rows, out_features, in_features, x_q.stride(0),
        weight.stride(0), out.stride(0), out_features,
        HAS_BIAS=bias is not None, GATED=gated, EXACT=is_interpreting(), SPLIT_K=split, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        PROMOTE_K=min(cfg.get("PROMOTE_K", cfg["BLOCK_K"]), cfg["BLOCK_K"]), **pdl_options(x_q.device),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _quantize_input(x, input_scale, reference: bool = False) -> QuantizedRows:
    """x quantized per token (`reference`: by the torch reference), or by a checkpoint's static scale;
    QuantizedRows as they are."""
    if isinstance(x, QuantizedRows):
        if input_scale is not None:
            raise ValueError("x is quantized per token already: a layer with a static input_scale cannot take it")
        return x
    return QuantizedRows.of(x, reference, static_scale=input_scale)


def linear_fp8(x, weight, weight_scale, bias=None, gated=False, block_size=None, input_scale=None,
               quantize_output=False):
    """x [T, K] (float, or QuantizedRows) @ dequantized weight [N, K] (e4m3, scales per row or per block).T
    (+ bias [N]) -> [T, N] in x's dtype; gated: silu(gate) * up of a [gate ; up] weight -> [T, N / 2], as
    QuantizedRows with quantize_output (for the FP8 layer that reads it). See the module doc."""
    if quantize_output and not gated:
        raise ValueError("quantize_output is for a gated layer: its SiLU-and-mul output feeds an FP8 layer")
    rows = x if isinstance(x, QuantizedRows) else None
    if rows is not None and block_size is not None:
        raise ValueError("QuantizedRows take per-row weight scales (a block-scaled weight quantizes x itself)")
    if not use_triton(x.values if rows is not None else x):
        return _output(linear_fp8_ref(x, weight, weight_scale, bias, gated, block_size, input_scale), quantize_output)
    per_row = block_size is None and x.dtype != torch.float32  # float32: the kernel's precise dot
    decode = x.shape[0] <= MAX_ROWS
    aligned = x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0  # cuBLASLt's FP8 alignment
    if per_row and aligned and (not decode or DECODE_IMPL == "scaled_mm"):
        return linear_fp8_scaled_mm(x, weight, weight_scale, bias, gated, input_scale, quantize_output)
    if rows is None and not (per_row and decode and DECODE_IMPL != "fused"):  # x quantized in the kernel's loop
        return _output(linear_fp8_triton(x, weight, weight_scale, bias, gated, block_size, input_scale),
                       quantize_output)
    rows = _quantize_input(x, input_scale)
    if per_row and decode and DECODE_IMPL == "swap":
        out = linear_fp8_swap(rows.values, rows.scale, weight, weight_scale, bias, gated, rows.dtype)
    else:
        out = linear_fp8_triton(rows.values, weight, weight_scale, bias, gated, x_scale=rows.scale,
                                out_dtype=rows.dtype)
    return _output(out, quantize_output)


def _output(out: torch.Tensor, quantize: bool):
    """A gated layer's output, quantized per token for the FP8 layer after it when asked (a pass of its own on
    these paths; after cuBLASLt's GEMM it is fused into SiLU-and-mul)."""
    return QuantizedRows.of(out) if quantize else out
