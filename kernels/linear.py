"""A decode-sized linear layer: a few rows of x against a large weight, streamed at the memory's speed, with
the Llama MLP's SiLU-and-mul fused into the gate/up projection.

    linear(x, w)                x @ w.T (+ bias)
    linear(x, w, gated=True)    silu(x @ w_gate.T) * (x @ w_up.T),   w = [w_gate ; w_up]

At batch 1 a decode step reads every weight once and does next to nothing with it; cuBLAS picks split-K GEMMs
there (a reduction kernel after some of them) and reaches 58% of the H200's copy bandwidth on the o projection
and 85% on the down projection. For x with at most `MAX_ROWS` rows on a GPU, one Triton kernel streams the weight
instead: each program owns BLOCK_N output features and walks K, with x padded to the 16 rows `tl.dot` needs
(the padding costs shared memory, not bandwidth). Larger batches keep cuBLAS (and `silu_and_mul` after it).

`python -m benchmarks.kernels --only linear` times a layer's projections both ways; `--tune` sweeps the launch
settings that `default_config` picks from. Fusing the RMSNorm before a projection into its loop was tried and
measured: the per-chunk rescaling and its reduction stalled the pipelined loads (qkv fell from 65% to 23%), so
the norm stays its own kernel.
"""

import functools

import torch
import torch.nn.functional as F

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    next_power_of_2,
    num_sms,
    pdl_options,
    shared_memory_per_block,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.activation import silu_and_mul, silu_and_mul_ref

MAX_ROWS = 16  # the kernel's batch limit (benchmarks/kernels.py --only linear: 1.07-1.08x cuBLAS at 1-16 rows)


@triton.jit
def rows_times_weight(a_ptr, a_rows, row_mask, stride_a, w_ptr, offs_n, n_mask, stride_w, up_row, K,
                      GATED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(acc, acc_up) float32 [BLOCK_M, BLOCK_N]: rows a_rows of a against weight rows offs_n (and, GATED, against
    rows up_row + offs_n), walking K in BLOCK_K steps. Shared by this file's kernel and kernels/moe.py's."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        xv = tl.load(a_ptr + a_rows[:, None] * stride_a + cols[None, :], mask=row_mask[:, None] & k_mask[None, :],
                     other=0.0)
        if UPCAST:
            xv = xv.to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + cols[None, :], mask=w_mask, other=0.0)
        acc += tl.dot(xv, tl.trans(w.to(xv.dtype)), input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_ptr + (up_row + offs_n)[:, None] * stride_w + cols[None, :], mask=w_mask, other=0.0)
            acc_up += tl.dot(xv, tl.trans(w_up.to(xv.dtype)), input_precision=PRECISION)
    return acc, acc_up


@triton.jit
def silu_mul_rounded(acc, acc_up, dtype: tl.constexpr):
    """silu(gate) * up from float32 accumulators, each step rounded to dtype as silu_and_mul rounds it."""
    gate = acc.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * acc_up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def store_split_k_slice(acc, acc_up, part_ptr, count_ptr, tile, mask, slot, GATED: tl.constexpr,
                        SPLIT_K: tl.constexpr):
    """Split K: stores this program's slice of a tile's sums (float32 [SPLIT_K, 2, BLOCK_M, N] workspace) and counts
    it; True for the tile's last program, which then adds them up and resets the count to 0 (for the next launch: a
    CUDA graph replays the same counts)."""
    base = part_ptr + tl.program_id(1) * 2 * slot
    tl.store(base + tile, acc, mask=mask)
    if GATED:
        tl.store(base + slot + tile, acc_up, mask=mask)
    tl.debug_barrier()  # every thread's slice is stored before the count says so
    done = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel")
    is_last = done == SPLIT_K - 1
    if is_last:
        tl.atomic_xchg(count_ptr + tl.program_id(0), 0)
    return is_last


@triton.jit
def store_output(acc, acc_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_row,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """A linear kernel's epilogue: + bias, then (GATED) silu(gate) * up, stored in out's dtype. acc, acc_up: float32
    [rows, BLOCK_N] (acc_up: the up half's, when gated). Shared by this file's kernel and kernels/linear_fp8.py's."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + up_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        out = silu_mul_rounded(acc, acc_up, dtype)
    else:
        out = acc.to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_o + offs_n[None, :], out, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, up_row,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    acc, acc_up = rows_times_weight(x_ptr, rows, row_mask, stride_x, w_ptr, offs_n, n_mask, stride_w, up_row, K,
                                    GATED, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_output(acc, acc_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_row, HAS_BIAS, GATED)


def _check_inputs(x, weight, bias, gated) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [T, K] and weight [N, K] must agree, got {tuple(x.shape)} and {tuple(weight.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks gate and up rows: an even row count, got {weight.shape[0]}")


def _block_m(num_rows: int) -> int:
    return max(16, next_power_of_2(num_rows))  # tl.dot's least; rows past num_rows are masked


@functools.lru_cache(maxsize=None)
def default_config(num_rows: int, out_features: int, gated: bool, dtype: torch.dtype, device: torch.device) -> dict:
    """Launch settings, from `python -m benchmarks.kernels --tune --only linear` on an H200 (Llama-3-8B, bf16):

        qkv      6144 x 4096    BLOCK_N 64, BLOCK_K 256, 4 stages   78%  (cuBLAS 72%)
        o        4096 x 4096    BLOCK_N 32, BLOCK_K 512, 4 stages   71%  (cuBLAS 58%)
        gate_up  2 x 14336      BLOCK_N 64, BLOCK_K 256, 3 stages   96%  (cuBLAS and silu_and_mul 88%)
        down     4096 x 14336   BLOCK_N 32, BLOCK_K 512, 4 stages   92%  (cuBLAS 85%)

    One program per SM streaming a wide tile beat several smaller ones: BLOCK_N is the widest that still gives
    programs for about 70% of the SMs. Stages and BLOCK_K then shrink until the tiles fit in shared memory
    (float32, or larger batches)."""
    sms = num_sms(device)
    block_n = next((n for n in (64, 32) if cdiv(out_features, n) >= 0.7 * sms), 16)
    block_k = 256 if gated or block_n == 64 else 512
    stages = 3 if gated else 4
    block_m, size, limit = _block_m(num_rows), dtype.itemsize, shared_memory_per_block(device)
    while stages * (block_m + block_n * (2 if gated else 1)) * block_k * size > limit and (stages > 2 or block_k > 32):
        if stages > 2:
            stages -= 1
        else:
            block_k //= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": stages}


def linear_triton(x, weight, bias=None, gated=False, config: dict | None = None):
    """Triton launcher of `linear` (any number of rows; it is fast for a few)."""
    _check_inputs(x, weight, bias, gated)
    check_launchable(*[t for t in (x, weight, bias) if t is not None])
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    num_rows, in_features = x.shape
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows > 0 and out_features > 0:
        cfg = {**default_config(num_rows, out_features, gated, x.dtype, x.device), **(config or {})}
        _linear_kernel[(cdiv(out_features, cfg["BLOCK_N"]),)](
            x, weight, bias if bias is not None else weight, out,
            num_rows, out_features, in_features, x.stride(0), weight.stride(0), out.stride(0), out_features,
            HAS_BIAS=bias is not None, GATED=gated, UPCAST=upcast_dot_operands(x.dtype, x.device),
            PRECISION=dot_precision(x.dtype), BLOCK_M=_block_m(num_rows), BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], **pdl_options(x.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out


def linear_ref(x, weight, bias=None, gated=False):
    """Torch reference of `linear`: F.linear, then silu_and_mul's reference when gated."""
    _check_inputs(x, weight, bias, gated)
    out = F.linear(x, weight, bias)
    return silu_and_mul_ref(out) if gated else out


def linear_cublas(x, weight, bias=None, gated=False):
    """`linear` for larger batches: F.linear (cuBLAS on a GPU), then `silu_and_mul` when gated."""
    out = F.linear(x, weight, bias)
    return silu_and_mul(out) if gated else out


def linear(x, weight, bias=None, gated=False):
    """x [T, K] @ weight [N, K].T (+ bias [N]) -> [T, N]; gated: weight stacks [gate ; up] rows and the result is
    silu(gate) * up, [T, N / 2], rounded as `silu_and_mul` rounds it.

    The Triton kernel for T <= MAX_ROWS on a GPU; otherwise `linear_cublas`.
    """
    if use_triton(x) and x.shape[0] <= MAX_ROWS:
        return linear_triton(x, weight, bias, gated)
    return linear_cublas(x, weight, bias, gated)
