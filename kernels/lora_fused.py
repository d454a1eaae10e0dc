"""LoRA with fewer launches and fewer bytes: the two paths a layer with adapters takes (kernels/lora.py holds the
shrink and expand kernels and their references).

    lora_apply          out += delta          decode-sized steps (T <= FUSED_MAX_TOKENS): one kernel, shrink and
                                              expand fused; larger steps: lora_shrink then lora_expand
    lora_silu_and_mul   silu(g') * u'          gate_up's output with its delta, [gate' ; up'] = out + delta, through
                                              the SiLU-and-mul; larger steps: lora_shrink then one kernel that
                                              expands and activates, `out` left as the base layer wrote it

Fused decode (`lora_fused_triton`): a program owns PROGRAM_N columns of one slice (BLOCK_N at a time, N_CHUNKS of
them) for a tile of rows; it first computes the tile's y = x @ A[slot, slice].T over the whole K itself (walking
the tile's slots as the shrink does), keeps y in registers, then expands its columns:

    program (slice i, columns c0..c0+PROGRAM_N)     x [T, K]  ──► y [T, R] (registers)  ──► out[:, c0..] += y @ B.T
                                                    A[slot, i] read from L2 by every program of slice i

It saves a launch and y's round trip per linear; it pays in L2 reads: every program re-reads x and its slice's A of
each distinct slot among the rows (R x K x 2 bytes: 128 KB at rank 16, K 4096). With P programs and d distinct
adapters that is P x d x 128 KB from L2 where the unfused shrink reads d x 128 KB from memory once: cheap while d
is 1 or 2, as in latency-bound decode (batch 1), not for a batch of 16 rows of 16 adapters. Hence
FUSED_MAX_TOKENS = 4 (CUDA graph buckets 1, 2 and 4), and programs of several column blocks (fewer programs:
fewer re-reads), P about a third of the SMs. `python -m benchmarks.kernels --only lora --cuda-graph` times the
fused kernel against shrink + expand at batches 1, 8, 16 and 64 (and `--tune` its N_CHUNKS).

Expand + SiLU-and-mul (`lora_expand_silu_triton`): in prefill-sized steps gate_up's output [T, 2I] is the
largest tensor of the layer; unfused, the expand reads and writes it whole and the activation reads it again. The
fused kernel reads it once and writes [T, I]: per element gate' = round(gate + delta_g), up' likewise (the expand's
one rounding), then `silu_and_mul`'s own roundings (kernels/activation.py), so its output equals the unfused path's.
"""

import functools

import torch

from kernels._triton import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_launchable,
    dot_precision,
    num_sms,
    pdl_options,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.lora import (
    _block_r,
    _check_expand,
    _check_order,
    _check_shrink,
    _is_aligned,
    _next_slot,
    _rows_times_a,
    _rows_times_b,
    _slice_of,
    _tile_rows,
    _y_slice,
    expand_config,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink_ref,
    lora_shrink_triton,
)

FUSED_MAX_TOKENS = 4  # steps of at most this many tokens take the fused kernel (see the module docstring)
SILU_MAX_RANK = 64  # past it the expand + SiLU kernel spills registers: the expand, then silu_and_mul


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_fused_kernel(out_ptr, x_ptr, a_ptr, b_ptr, slots_ptr, num_tokens, K, R, first_block1, first_block2,
                       start0, start1, start2, end0, end1, end2, stride_ot, stride_xt, stride_as, stride_ai,
                       stride_ar, stride_bs, stride_bn, HI_LO: tl.constexpr, UPCAST: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       N_CHUNKS: tl.constexpr, PROGRAM_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[rows, PROGRAM_N columns of one slice] = round(out + (x[rows] @ A[slot, slice].T) @ B[slot, cols].T),
    rows of slot -1 untouched. Grid: (column blocks of PROGRAM_N over all slices, row tiles)."""
    wait_for_prior(PDL)
    slice_id, first, end = _slice_of(tl.program_id(0), first_block1, first_block2, start0, start1, start2, end0,
                                     end1, end2, PROGRAM_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_tokens
    rows = rows.to(tl.int64)
    slots = tl.load(slots_ptr + rows, mask=row_mask, other=-1).to(tl.int32)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    a_slice = a_ptr + slice_id * stride_ai
    y = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)  # each row's y against its own slot's A
    slot = _next_slot(slots, -1)
    if slot == tl.max(slots, 0):  # one adapter in the tile: a loop the compiler pipelines
        y = _rows_times_a(y, x_ptr, rows, slots == slot, stride_xt, a_slice + slot.to(tl.int64) * stride_as,
                          stride_ar, rank_mask, 0, K, UPCAST, PRECISION, BLOCK_K)
    else:
        while slot < (1 << 30):
            y = _rows_times_a(y, x_ptr, rows, slots == slot, stride_xt, a_slice + slot.to(tl.int64) * stride_as,
                              stride_ar, rank_mask, 0, K, UPCAST, PRECISION, BLOCK_K)
            slot = _next_slot(slots, slot)
    out_rows = row_mask & (slots >= 0)
    for chunk in tl.static_range(N_CHUNKS):
        cols = first + chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        slot = _next_slot(slots, -1)
        while slot < (1 << 30):
            bv = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn + ranks[None, :],
                         mask=col_mask[:, None] & rank_mask[None, :], other=0.0)
            acc = _rows_times_b(acc, tl.where((slots == slot)[:, None], y, 0.0), bv, HI_LO, UPCAST, PRECISION)
            slot = _next_slot(slots, slot)
        out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :]
        out_mask = out_rows[:, None] & col_mask[None, :]
        old = tl.load(out_ptrs, mask=out_mask, other=0.0)
        tl.store(out_ptrs, (old.to(tl.float32) + acc).to(old.dtype), mask=out_mask)


@triton.jit
def _expanded(out_ptrs, mask, y_ptr, rows, slots, stride_yt, b_ptr, cols, col_mask, stride_bs, stride_bn, ranks,
              rank_mask, HI_LO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """round(out + y[rows] @ B[slot(row), cols].T) at out_ptrs, in out's dtype (not stored), as lora_expand rounds."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    slot = _next_slot(slots, -1)
    while slot < (1 << 30):
        yv = tl.load(y_ptr + rows[:, None] * stride_yt + ranks[None, :],
                     mask=(slots == slot)[:, None] & rank_mask[None, :], other=0.0)
        bv = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn + ranks[None, :],
                     mask=col_mask[:, None] & rank_mask[None, :], other=0.0)
        acc = _rows_times_b(acc, yv, bv, HI_LO, UPCAST, PRECISION)
        slot = _next_slot(slots, slot)
    old = tl.load(out_ptrs, mask=mask, other=0.0)
    return (old.to(tl.float32) + acc).to(old.dtype)  # rows of slot -1 add zeros: unchanged


@triton.jit(do_not_specialize=["num_tokens", "stride_yi"])
def _lora_expand_silu_kernel(act_ptr, out_ptr, y_ptr, b_ptr, slots_ptr, order_ptr, num_tokens, R, inter_size, stride_at,
                             stride_ot, stride_yi, stride_yt, stride_bs, stride_bn, HI_LO: tl.constexpr,
                             Y_ALIGNED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                             SORTED: tl.constexpr, PDL: tl.constexpr):
    """act[rows, cols] = silu(round(gate + y[0] @ B_gate.T)) * round(up + y[1] @ B_up.T), rounded as
    silu_and_mul rounds; gate = out[:, cols], up = out[:, I + cols]. Grid: (column blocks of I, row tiles). Gate's
    sum is finished (and held in 16 bits) before up's starts: one slice's y and B tiles live at a time, which keeps
    rank 64 and 128 in registers."""
    wait_for_prior(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter_size
    rows, row_mask = _tile_rows(order_ptr, num_tokens, BLOCK_M, SORTED)
    slots = tl.load(slots_ptr + rows, mask=row_mask, other=-1).to(tl.int32)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    mask = row_mask[:, None] & col_mask[None, :]
    gate_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    gate = _expanded(gate_ptrs, mask, _y_slice(y_ptr, 0, stride_yi, Y_ALIGNED), rows, slots, stride_yt, b_ptr, cols,
                     col_mask, stride_bs, stride_bn, ranks, rank_mask, HI_LO, UPCAST, PRECISION, BLOCK_M, BLOCK_N)
    up = _expanded(gate_ptrs + inter_size, mask, _y_slice(y_ptr, 1, stride_yi, Y_ALIGNED), rows, slots, stride_yt,
                   b_ptr, inter_size + cols, col_mask, stride_bs, stride_bn, ranks, rank_mask, HI_LO, UPCAST,
                   PRECISION, BLOCK_M, BLOCK_N)
    g = gate.to(tl.float32)  # then silu_and_mul's roundings (kernels/activation.py)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], (silu * up.to(tl.float32)).to(gate.dtype),
             mask=mask)


@functools.lru_cache(maxsize=None)
def fused_config(num_tokens: int, num_cols: int, rank: int, dtype: torch.dtype, device: torch.device) -> dict:
    """One row tile (16 rows) for decode; columns in 128s (64 for float32 or past rank 32), N_CHUNKS of them a
    program so that the programs number about a third of the SMs (each re-reads A: fewer is less L2 traffic, too
    few leaves the expand's B reads on few SMs); BLOCK_K as the shrink's; 4 warps (rank 128's 8 warps spilled)."""
    block_r = _block_r(rank)
    block_n = 128 if block_r <= 32 and dtype != torch.float32 else 64
    chunks = max(1, cdiv(num_cols, block_n) // max(1, num_sms(device) // 3))
    return {"BLOCK_M": 16 if num_tokens <= 16 else 32, "BLOCK_N": block_n, "N_CHUNKS": chunks,
            "BLOCK_K": 128 if block_r <= 64 and dtype != torch.float32 else 64,
            "num_warps": 4, "num_stages": 3}


@functools.lru_cache(maxsize=None)
def expand_silu_config(num_tokens: int, rank: int, dtype: torch.dtype) -> dict:
    """The expand's row tiles (kernels/lora.py `expand_config`), 64 columns: two slices' sums, compiled for sm_90,
    take 130 registers a thread at rank 16 and 182 at rank 64 with 64 x 64 tiles and 8 warps, none spilled
    (64 x 128 needed 192 and spilled from rank 64 on; rank 128 spills at every tile tried, hence SILU_MAX_RANK)."""
    block_m = expand_config(num_tokens, rank, dtype)["BLOCK_M"]
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "num_warps": 8 if block_m == 64 else 4, "num_stages": 1}


def lora_fused_triton(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      slots: torch.Tensor, slice_starts: tuple[int, ...], config: dict | None = None) -> None:
    """In place, as `lora_expand(out, lora_shrink(x, lora_a, slots), lora_b, slots, slice_starts)`, in one launch
    (meant for decode-sized T; any T works). config overrides `fused_config`'s keys (tests, tuning)."""
    _check_shrink(x, lora_a, slots)
    num_tokens, rank, num_slices = x.shape[0], lora_a.shape[2], lora_a.shape[1]
    y_shape = torch.empty(num_slices, num_tokens, rank, dtype=torch.float32, device="meta")
    _check_expand(out, y_shape, lora_b, slots, slice_starts)
    check_launchable(out, x, lora_a, lora_b, slots)
    for name, t in (("out", out), ("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        check_last_dim_contiguous(name, t)
    if num_slices > 3:
        raise ValueError(f"the fused LoRA kernel takes 1 to 3 slices, got {num_slices}")
    if num_tokens == 0 or num_slices == 0:
        return
    n = out.shape[1]
    ends = tuple(slice_starts[1:]) + (n,)
    cfg = {**fused_config(num_tokens, n - slice_starts[0], rank, out.dtype, out.device), **(config or {})}
    program_n = cfg["BLOCK_N"] * cfg["N_CHUNKS"]
    n_blocks = [cdiv(end - start, program_n) for start, end in zip(slice_starts, ends)]
    first_blocks = [sum(n_blocks[:i]) if i < num_slices else 1 << 30 for i in (1, 2)]
    pad = (0,) * (3 - num_slices)
    grid = (sum(n_blocks), cdiv(num_tokens, cfg["BLOCK_M"]))
    if grid[0] == 0:
        return
    _lora_fused_kernel[grid](
        out, x, lora_a, lora_b, slots, num_tokens, x.shape[1], rank, *first_blocks, *slice_starts, *pad, *ends,
        *pad, out.stride(0), x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_b.stride(0),
        lora_b.stride(1), HI_LO=out.dtype != torch.float32, UPCAST=upcast_dot_operands(out.dtype, out.device),
        PRECISION=dot_precision(out.dtype), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        N_CHUNKS=cfg["N_CHUNKS"], PROGRAM_N=program_n, BLOCK_R=_block_r(rank), BLOCK_K=cfg["BLOCK_K"],
        **pdl_options(out.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _check_gate_up(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> int:
    if out.dim() != 2 or out.shape[1] % 2:
        raise ValueError(f"out must be [T, 2 * I] (gate ; up), got {tuple(out.shape)}")
    inter_size = out.shape[1] // 2
    _check_expand(out, y, lora_b, slots, (0, inter_size))
    return inter_size


def lora_expand_silu_triton(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                            config: dict | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(out after lora_expand(out, y, lora_b, slots, (0, I))) in one kernel: [T, I] in out's dtype;
    out itself is left unchanged. config overrides `expand_silu_config`'s keys; order: the rows sorted by slot
    (kernels/lora.py `lora_shrink_triton`)."""
    inter_size = _check_gate_up(out, y, lora_b, slots)
    _check_order(order, out.shape[0])
    check_dtype("out", out, FLOAT_DTYPES)
    check_launchable(out, y, lora_b, slots)
    for name, t in (("out", out), ("y", y), ("lora_b", lora_b)):
        check_last_dim_contiguous(name, t)
    num_tokens, rank = y.shape[1], y.shape[2]
    act = torch.empty(num_tokens, inter_size, dtype=out.dtype, device=out.device)
    if num_tokens == 0 or inter_size == 0:
        return act
    cfg = {**expand_silu_config(num_tokens, rank, out.dtype), **(config or {})}
    grid = (cdiv(inter_size, cfg["BLOCK_N"]), cdiv(num_tokens, cfg["BLOCK_M"]))
    _lora_expand_silu_kernel[grid](
        act, out, y, lora_b, slots, slots if order is None else order, num_tokens, rank, inter_size, act.stride(0),
        out.stride(0), y.stride(0),
        y.stride(1), lora_b.stride(0), lora_b.stride(1), HI_LO=out.dtype != torch.float32, Y_ALIGNED=_is_aligned(y),
        UPCAST=upcast_dot_operands(out.dtype, out.device), PRECISION=dot_precision(out.dtype),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=_block_r(rank), SORTED=order is not None,
        **pdl_options(out.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return act


def _kernel_wanted(tensor: torch.Tensor, use_kernel: bool | None) -> bool:
    return use_triton(tensor) if use_kernel is None else use_kernel


def lora_apply(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
               slice_starts: tuple[int, ...], *, use_kernel: bool | None = None,
               order: torch.Tensor | None = None) -> None:
    """In place: out [T, N] += each token's adapter delta, (x [T, K] @ lora_a[slot].T) @ lora_b[slot].T per slice
    (kernels/lora.py's shapes; slot -1 rows untouched). The fused kernel for T <= FUSED_MAX_TOKENS, else the shrink
    and the expand (given `order`, the rows sorted by slot, they tile the sorted rows); use_kernel as
    `lora_shrink`'s (False: the references)."""
    if not _kernel_wanted(out, use_kernel):
        lora_expand_ref(out, lora_shrink_ref(x, lora_a, slots), lora_b, slots, slice_starts)
    elif x.shape[0] <= FUSED_MAX_TOKENS:
        lora_fused_triton(out, x, lora_a, lora_b, slots, slice_starts)
    else:
        y = lora_shrink_triton(x, lora_a, slots, order=order)
        lora_expand_triton(out, y, lora_b, slots, slice_starts, order=order)


def lora_silu_and_mul(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      slots: torch.Tensor, *, use_kernel: bool | None = None,
                      order: torch.Tensor | None = None) -> torch.Tensor:
    """A gate_up layer's activation with its adapters: silu_and_mul(out + delta) [T, I], out [T, 2I] = [gate ; up]
    (two slices of I columns). The expand fused into the activation from FUSED_MAX_TOKENS + 1 tokens on and up to
    SILU_MAX_RANK, else lora_apply then silu_and_mul; out may be changed (the delta added in place) or not."""
    if not _kernel_wanted(out, use_kernel):
        lora_expand_ref(out, lora_shrink_ref(x, lora_a, slots), lora_b, slots, (0, out.shape[1] // 2))
        return silu_and_mul_ref(out)
    if x.shape[0] <= FUSED_MAX_TOKENS or lora_a.shape[2] > SILU_MAX_RANK:
        lora_apply(out, x, lora_a, lora_b, slots, (0, out.shape[1] // 2), use_kernel=True, order=order)
        return silu_and_mul_triton(out)
    return lora_expand_silu_triton(out, lora_shrink_triton(x, lora_a, slots, order=order), lora_b, slots,
                                   order=order)
