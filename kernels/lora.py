"""Batched LoRA: the rows of one step carry many adapters (or none), each row indexed by its adapter's slot.

Every adapter resident on the GPU has a slot in stacked tensors; a projection's LoRA delta is two thin GEMMs:

    shrink   y[i, t]   = A[slot(t), i] @ x[t]             A  lora_a [S, n_slices, R, K]    y float32 [n_slices, T, R]
    expand   out[t, c] += y[i(c), t] @ B[slot(t), c]      B  lora_b [S, N, R]   (scaling folded into B)

A fused projection has several slices (q/k/v: 3, gate/up: 2), each with its own A; its B is one [N, R] matrix
per slot whose column ranges [slice_starts[i], slice_starts[i + 1]) (the last up to N) belong to slice i. Ranks
below R are padded with zeros, and slot -1 means no adapter: y = 0 and the output row untouched.

One Triton kernel each serves prefill (SGMV: a sequence's rows are contiguous and share a slot) and decode
(BGMV: one row per sequence, each its own slot): a program owns BLOCK_M rows and walks the distinct slots among
them (a data-dependent loop, usually one trip in prefill), multiplying only the rows of each slot against that
slot's A or B tile:

    rows of a tile   slots   [ 3 3 3 3 | 3 3 1 1 | -1 0 5 0 ]    trips: 1 | 2 (slots 1, 3) | 2 (slots 0, 5)

Each trip re-reads the slot's A or B tile (from L2: an adapter's A and B are some 100 KB at rank 16), so a decode
tile of rows that interleave 8 adapters walks up to 8 slots. Given `order`, the rows sorted by slot (an argsort of
`slots`: the engine's InputBuffers compute it on the host once a step), a tile takes the rows at its positions of
`order` instead (it gathers their x, y and out rows): only the few slots of its run of sorted rows (some 32
rows an adapter at 256 rows over 8), the same sums. The launchers ignore it where the rows fit one tile, whose walk
sorting cannot shorten. Shrink splits K over programs when the tiles alone would not fill the GPU: each program
stores its partial sums, and the last of a tile's programs to finish (an arrival count, reset by it for the next
launch) adds them up in a fixed order and writes y, so y is the same run to run and needs no zeroed buffer (a
memset was a third launch per adapted linear at decode sizes). Expand adds to `out` in float32 and rounds once. No
host sync, no per-adapter loop: a decode call is CUDA-graph capturable, and the slots (and the order) may change
between replays.

Float32 y meets 16-bit B in expand as two 16-bit tensor-core dots, y = hi + lo with hi = y rounded to B's dtype
and lo the rest: 16 bits of y's mantissa instead of 8, at the cost of a second dot on a memory-bound kernel (fp16
needs |y| < 65504). `python -m benchmarks.kernels --only lora` times both at Llama-3-8B's shapes against the base
layer's matmul.
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
    next_power_of_2,
    num_sms,
    pdl_options,
    split_counts,
    tl,
    triton,
    upcast_dot_operands,
    use_triton,
    wait_for_prior,
)

MAX_RANK = 128  # the kernels' limit on R (expand's B tile narrows past 64)
MAX_SHRINK_PARTS = 8192  # split K: the partial sums [SPLIT_K, BLOCK_M, BLOCK_R] a tile's last program loads at once


@triton.jit
def _next_slot(slots, after):
    """The smallest slot above `after` among the tile's rows (1 << 30 when none: the walk ends)."""
    return tl.min(tl.where(slots > after, slots, 1 << 30), 0)


@triton.jit
def _rows_times_a(acc, x_ptr, rows, is_slot, stride_xt, a_ptr, stride_ar, rank_mask, k_lo, k_hi,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[rows of one slot, k_lo:k_hi] @ A[:, k_lo:k_hi].T (the other rows read as zeros)."""
    ranks = tl.arange(0, acc.shape[1])
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < k_hi
        xv = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=is_slot[:, None] & k_mask[None, :],
                     other=0.0)
        av = tl.load(a_ptr + ranks[:, None] * stride_ar + cols[None, :], mask=rank_mask[:, None] & k_mask[None, :],
                     other=0.0)
        if UPCAST:
            xv, av = xv.to(tl.float32), av.to(tl.float32)
        acc += tl.dot(xv, tl.trans(av), input_precision=PRECISION)
    return acc


@triton.jit
def _tile_rows(order_ptr, num_tokens, BLOCK_M: tl.constexpr, SORTED: tl.constexpr):
    """The rows of this program's tile (program_id(1)) and which exist: BLOCK_M consecutive rows, or with SORTED
    the rows at those positions of `order` (the rows sorted by slot: a tile then holds few slots)."""
    positions = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = positions < num_tokens
    if SORTED:
        rows = tl.load(order_ptr + positions, mask=row_mask, other=0).to(tl.int64)
    else:
        rows = positions.to(tl.int64)
    return rows, row_mask


@triton.jit
def _y_slice(y_ptr, slice_id, stride_yi, Y_ALIGNED: tl.constexpr):
    """y's slice; Y_ALIGNED (its strides multiples of 4, as shrink writes it): so the compiler knows, and loads
    and stores 4 floats at a time (the slice stride, T * R, is not specialized on)."""
    offset = slice_id * stride_yi
    if Y_ALIGNED:
        offset = tl.multiple_of(offset, 4)
    return y_ptr + offset


# The token count and y's slice stride (T * R) change every step: specializing on them would compile new variants
# while requests wait.
@triton.jit(do_not_specialize=["num_tokens", "k_blocks_per_split", "stride_yi", "stride_part"])
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, order_ptr, y_ptr, part_ptr, count_ptr, num_tokens, K, R,
                        k_blocks_per_split, stride_xt, stride_as, stride_ai, stride_ar, stride_yi, stride_yt,
                        stride_part, NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_P: tl.constexpr,
                        Y_ALIGNED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SORTED: tl.constexpr,
                        PDL: tl.constexpr):
    """y[slice, rows of the tile] = x[rows] @ A[slot(row), slice].T. Grid: (slices x splits, row tiles); a tile's
    slices run side by side and share its x rows in L2. SPLIT_K > 1: each program sums one slice of K into
    part [SPLIT_K, n_slices, T, R] (y's layout, stride_part apart) and the tile's last program (count_ptr: one int32
    count per (slice, row tile), at 0 between launches) adds the SPLIT_K parts into y, in a fixed order (SPLIT_P:
    SPLIT_K's next power of two)."""
    wait_for_prior(PDL)
    pid = tl.program_id(0)
    slice_id, split = pid % NUM_SLICES, pid // NUM_SLICES
    rows, row_mask = _tile_rows(order_ptr, num_tokens, BLOCK_M, SORTED)
    slots = tl.load(slots_ptr + rows, mask=row_mask, other=-1).to(tl.int32)
    ranks = tl.arange(0, BLOCK_R)
    k_lo = split * k_blocks_per_split * BLOCK_K  # a multiple of BLOCK_K, as the compiler sees: vector loads, pipelined
    k_hi = tl.minimum(k_lo + k_blocks_per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    slot = _next_slot(slots, -1)
    a_slice = a_ptr + slice_id * stride_ai
    if slot == tl.max(slots, 0):  # one adapter in the tile (prefill): a loop the compiler pipelines
        acc = _rows_times_a(acc, x_ptr, rows, slots == slot, stride_xt, a_slice + slot.to(tl.int64) * stride_as,
                            stride_ar, ranks < R, k_lo, k_hi, UPCAST, PRECISION, BLOCK_K)
    else:
        while slot < (1 << 30):
            acc = _rows_times_a(acc, x_ptr, rows, slots == slot, stride_xt, a_slice + slot.to(tl.int64) * stride_as,
                                stride_ar, ranks < R, k_lo, k_hi, UPCAST, PRECISION, BLOCK_K)
            slot = _next_slot(slots, slot)
    y_offsets = rows.to(tl.int32)[:, None] * stride_yt + ranks[None, :]  # int32: y is small (fewer registers)
    y_mask = row_mask[:, None] & (ranks < R)[None, :]
    y_slice = _y_slice(y_ptr, slice_id, stride_yi, Y_ALIGNED)
    if SPLIT_K == 1:
        tl.store(y_slice + y_offsets, acc, mask=y_mask)
    else:
        part_slice = _y_slice(part_ptr, slice_id, stride_yi, Y_ALIGNED)
        tl.store(part_slice + split * stride_part + y_offsets, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's part is stored before the count says so
        count = count_ptr + slice_id + NUM_SLICES * tl.program_id(1)
        if tl.atomic_add(count, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.atomic_xchg(count, 0)
            splits = tl.arange(0, SPLIT_P)[:, None, None]
            parts = tl.load(part_slice + splits * stride_part + y_offsets[None, :, :],
                            mask=(splits < SPLIT_K) & y_mask[None, :, :], other=0.0, cache_modifier=".cg")
            tl.store(y_slice + y_offsets, tl.sum(parts, 0), mask=y_mask)


@triton.jit
def _slice_of(pid_n, first_block1, first_block2, start0, start1, start2, end0, end1, end2, BLOCK_N: tl.constexpr):
    """(slice, first column of this program, the slice's end) for column block pid_n, the blocks counted slice
    after slice (a slice that does not exist starts at block 1 << 30)."""
    slice_id = (pid_n >= first_block1).to(tl.int32) + (pid_n >= first_block2).to(tl.int32)
    block = pid_n - tl.where(slice_id == 0, 0, tl.where(slice_id == 1, first_block1, first_block2))
    first = tl.where(slice_id == 0, start0, tl.where(slice_id == 1, start1, start2)) + block * BLOCK_N
    end = tl.where(slice_id == 0, end0, tl.where(slice_id == 1, end1, end2))
    return slice_id, first, end


@triton.jit(do_not_specialize=["num_tokens", "stride_yi"])
def _lora_expand_kernel(out_ptr, y_ptr, b_ptr, slots_ptr, order_ptr, num_tokens, R, first_block1, first_block2,
                        start0, start1, start2, end0, end1, end2, stride_ot, stride_yi, stride_yt, stride_bs,
                        stride_bn, HI_LO: tl.constexpr, Y_ALIGNED: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, SORTED: tl.constexpr, OUT_FIRST: tl.constexpr, PDL: tl.constexpr):
    """out[rows, columns of one slice's block] = round(out + y[slice, rows] @ B[slot(row), columns].T), rows of
    slot -1 untouched. Grid: (column blocks of all slices, row tiles). OUT_FIRST: out's tile is loaded before the
    walk over the slots (its latency under the y and B loads and the dots), not after it."""
    wait_for_prior(PDL)
    slice_id, first, end = _slice_of(tl.program_id(0), first_block1, first_block2, start0, start1, start2, end0,
                                     end1, end2, BLOCK_N)
    rows, row_mask = _tile_rows(order_ptr, num_tokens, BLOCK_M, SORTED)
    slots = tl.load(slots_ptr + rows, mask=row_mask, other=-1).to(tl.int32)
    cols = first + tl.arange(0, BLOCK_N)
    col_mask = cols < end
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    out_mask = (row_mask & (slots >= 0))[:, None] & col_mask[None, :]
    if OUT_FIRST:
        old = tl.load(out_ptrs, mask=out_mask, other=0.0)
    slot = _next_slot(slots, -1)
    while slot < (1 << 30):
        is_slot = slots == slot
        yv = tl.load(_y_slice(y_ptr, slice_id, stride_yi, Y_ALIGNED) + rows[:, None] * stride_yt + ranks[None, :],
                     mask=is_slot[:, None] & rank_mask[None, :], other=0.0)
        bv = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn + ranks[None, :],
                     mask=col_mask[:, None] & rank_mask[None, :], other=0.0)
        if HI_LO:  # y = hi + lo, both in B's dtype: two 16-bit dots keep 16 bits of y's mantissa
            hi = yv.to(bv.dtype)
            lo = (yv - hi.to(tl.float32)).to(bv.dtype)
            if UPCAST:
                hi, lo, bv = hi.to(tl.float32), lo.to(tl.float32), bv.to(tl.float32)
            acc += tl.dot(hi, tl.trans(bv), input_precision=PRECISION)
            acc += tl.dot(lo, tl.trans(bv), input_precision=PRECISION)
        else:
            acc += tl.dot(yv, tl.trans(bv.to(tl.float32)), input_precision=PRECISION)
        slot = _next_slot(slots, slot)
    if not OUT_FIRST:
        old = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, (old.to(tl.float32) + acc).to(old.dtype), mask=out_mask)


def _check_slots(slots: torch.Tensor, num_tokens: int) -> None:
    if slots.dim() != 1 or slots.shape[0] != num_tokens:
        raise ValueError(f"slots must be [T={num_tokens}], got {tuple(slots.shape)}")
    check_dtype("slots", slots, (torch.int32, torch.int64))


def _check_order(order: torch.Tensor | None, num_tokens: int) -> None:
    if order is None:
        return
    if order.dim() != 1 or order.shape[0] != num_tokens:
        raise ValueError(f"order must be [T={num_tokens}] (a permutation of the rows), got {tuple(order.shape)}")
    check_dtype("order", order, (torch.int32, torch.int64))


def _sorted(order: torch.Tensor | None, num_tokens: int, block_m: int) -> bool:
    """Whether the tiles take the rows through `order`: not when they are one tile, which walks the same slots
    either way (sorting would only add a load)."""
    return order is not None and num_tokens > block_m


def _check_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got {tuple(x.shape)}")
    if lora_a.dim() != 4 or lora_a.shape[3] != x.shape[1]:
        raise ValueError(f"lora_a must be [S, n_slices, R, K={x.shape[1]}], got {tuple(lora_a.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a must have x's dtype {x.dtype}, got {lora_a.dtype}")
    _check_slots(slots, x.shape[0])


def _check_expand(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                  slice_starts: tuple[int, ...]) -> None:
    if out.dim() != 2:
        raise ValueError(f"out must be [T, N], got {tuple(out.shape)}")
    num_tokens, n = out.shape
    if lora_b.dim() != 3 or lora_b.shape[1] != n:
        raise ValueError(f"lora_b must be [S, N={n}, R], got {tuple(lora_b.shape)}")
    if y.dim() != 3 or y.shape[1:] != (num_tokens, lora_b.shape[2]):
        raise ValueError(f"y must be [n_slices, T={num_tokens}, R={lora_b.shape[2]}], got {tuple(y.shape)}")
    check_dtype("out", out, FLOAT_DTYPES)
    if lora_b.dtype != out.dtype:
        raise ValueError(f"lora_b must have out's dtype {out.dtype}, got {lora_b.dtype}")
    check_dtype("y", y, (torch.float32,))
    starts = tuple(slice_starts)
    if len(starts) != y.shape[0] or not all(isinstance(s, int) for s in starts):
        raise ValueError(f"slice_starts must hold {y.shape[0]} ints (one per slice of y), got {slice_starts!r}")
    if any(a > b for a, b in zip(starts, starts[1:] + (n,))) or (starts and starts[0] < 0):
        raise ValueError(f"slice_starts must rise from >= 0 to <= N={n}, got {slice_starts!r}")
    _check_slots(slots, num_tokens)


@functools.lru_cache(maxsize=None)
def shrink_config(num_tokens: int, in_features: int, rank: int, num_slices: int, dtype: torch.dtype,
                  device: torch.device) -> dict:
    """Row tiles of 16 for decode-sized batches, 32 up to 4096 rows (a grid that fills the GPU at 2048), then 64;
    BLOCK_K 128 with 4 warps, 64 with 8 past rank 64 (and 64 for float32), 3 stages: no register spills on sm_90
    (tests/kernels/test_kernel_compile.py). When the tiles x slices would leave SMs idle (decode), K is split over
    programs until there are some two an SM: a few programs cannot stream A and x at the memory's speed (at rank
    64 in 16-row tiles), with at most MAX_SHRINK_PARTS partial sums for a tile's last program to add up."""
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens < 4096 else 64
    block_r = _block_r(rank)
    block_k = 128 if block_r <= 64 and dtype != torch.float32 else 64
    programs = cdiv(num_tokens, block_m) * num_slices
    split_k = 1
    if programs < num_sms(device):
        if block_r == 64:  # split K at rank 64: 32-row tiles spilled a register on sm_90 (4 warps, 168 registers)
            block_m = 16
            programs = cdiv(num_tokens, block_m) * num_slices
        split_k = max(1, min(cdiv(in_features, block_k), cdiv(2 * num_sms(device), programs),
                             MAX_SHRINK_PARTS // (block_m * block_r)))
    return {"BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4 if block_r <= 64 else 8,
            "num_stages": 3}


@functools.lru_cache(maxsize=None)
def expand_config(num_tokens: int, rank: int, dtype: torch.dtype) -> dict:
    """Row tiles of 16 for decode-sized batches, else up to 64 (fewer re-reads of a slot's B when a tile holds
    several slots); columns in 128s, 64s from rank 64 on and for float32, 8 warps past rank 64: no spills."""
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_n = 128 if _block_r(rank) <= 32 and dtype != torch.float32 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 8 if _block_r(rank) > 64 else 4, "num_stages": 1}


def _is_aligned(y: torch.Tensor) -> bool:
    return y.stride(0) % 4 == 0 and y.stride(1) % 4 == 0 and y.data_ptr() % 16 == 0


def _block_r(rank: int) -> int:
    if rank > MAX_RANK:
        raise ValueError(f"LoRA rank R={rank} exceeds the kernels' MAX_RANK={MAX_RANK}")
    return max(16, next_power_of_2(rank))


# A launch's plan (its checks passed, its grid, its scalar and constexpr arguments) for each signature of the
# call: the shapes, strides, dtypes and devices of its tensors and the config override. A step calls these two
# launchers twice for every adapted linear; checking and deriving all this on each call cost more host time than
# the Triton launch itself. Token counts vary step by step, so the caches hold one plan per count seen (bounded by
# max_num_batched_tokens and the model's few linear shapes).
_SHRINK_PLANS: dict[tuple, tuple] = {}
_EXPAND_PLANS: dict[tuple, tuple | None] = {}


def _signature(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _config_key(config: dict | None) -> tuple | None:
    return None if config is None else tuple(sorted(config.items()))


def _shrink_plan(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, config: dict | None,
                 order: torch.Tensor | None) -> tuple:
    """(y's shape, SPLIT_K, grid, the kernel's scalar arguments after count_ptr, its keyword arguments, whether the
    tiles take the rows through `order`), or y's shape alone when there is nothing to launch."""
    _check_shrink(x, lora_a, slots)
    _check_order(order, x.shape[0])
    check_launchable(x, lora_a, slots, *(() if order is None else (order,)))
    for name, t in (("x", x), ("lora_a", lora_a)):
        check_last_dim_contiguous(name, t)
    num_tokens, k = x.shape
    _, num_slices, rank, _ = lora_a.shape
    y_shape = (num_slices, num_tokens, rank)
    if num_tokens == 0 or num_slices == 0:
        return (y_shape,)
    cfg = {**shrink_config(num_tokens, k, rank, num_slices, x.dtype, x.device), **(config or {})}
    split_k = cfg["SPLIT_K"]
    block_r = _block_r(rank)
    if split_k > 1 and next_power_of_2(split_k) * cfg["BLOCK_M"] * block_r > MAX_SHRINK_PARTS:
        raise ValueError(f"SPLIT_K={split_k} x BLOCK_M={cfg['BLOCK_M']} x BLOCK_R={block_r} partial sums exceed "
                         f"MAX_SHRINK_PARTS={MAX_SHRINK_PARTS}")
    k_blocks_per_split = cdiv(cdiv(k, split_k), cfg["BLOCK_K"])
    grid = (num_slices * split_k, cdiv(num_tokens, cfg["BLOCK_M"]))
    is_sorted = _sorted(order, num_tokens, cfg["BLOCK_M"])
    # y (and each split's part) is a new contiguous tensor: its strides are (T * R, R), and the allocator aligns its
    # start (16 bytes at least)
    scalars = (num_tokens, k, rank, k_blocks_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1),
               lora_a.stride(2), num_tokens * rank, rank, num_slices * num_tokens * rank)
    kwargs = dict(NUM_SLICES=num_slices, SPLIT_K=split_k, SPLIT_P=next_power_of_2(split_k),
                  Y_ALIGNED=num_tokens * rank % 4 == 0 and rank % 4 == 0,
                  UPCAST=upcast_dot_operands(x.dtype, x.device), PRECISION=dot_precision(x.dtype),
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_R=block_r, BLOCK_K=cfg["BLOCK_K"], SORTED=is_sorted,
                  **pdl_options(x.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y_shape, split_k, grid, scalars, kwargs, is_sorted


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
                       config: dict | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher of `lora_shrink`; config overrides `shrink_config`'s keys (tests, tuning); order as
    `lora_shrink`'s. Its checks and launch parameters are worked out once per call signature (`_SHRINK_PLANS`)."""
    key = (_signature(x, lora_a, slots, order), _config_key(config))
    plan = _SHRINK_PLANS.get(key)
    if plan is None:
        plan = _SHRINK_PLANS[key] = _shrink_plan(x, lora_a, slots, config, order)
    if len(plan) == 1:
        return torch.zeros(plan[0], dtype=torch.float32, device=x.device)
    y_shape, split_k, grid, scalars, kwargs, is_sorted = plan
    # the shrink's own counts: workers/side_stream.py runs it beside a base matmul that may split K too
    counts = split_counts(x.device, grid[0] // split_k * grid[1], "lora shrink") if split_k > 1 else None
    if split_k > 1 and counts is None:  # captured before an eager call made enough counts: K unsplit
        return lora_shrink_triton(x, lora_a, slots, {**(config or {}), "SPLIT_K": 1}, order)
    y = torch.empty(y_shape, dtype=torch.float32, device=x.device)
    parts = torch.empty((split_k, *y_shape), dtype=torch.float32, device=x.device) if split_k > 1 else y
    _lora_shrink_kernel[grid](x, lora_a, slots, order if is_sorted else slots, y, parts,
                              counts if counts is not None else slots, *scalars, **kwargs)
    return y


def _expand_plan(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                 slice_starts: tuple[int, ...], config: dict | None, order: torch.Tensor | None) -> tuple | None:
    """(grid, the kernel's scalar arguments after `order`, its keyword arguments, whether the tiles take the rows
    through `order`), or None when there is nothing to launch."""
    _check_expand(out, y, lora_b, slots, slice_starts)
    _check_order(order, out.shape[0])
    check_launchable(out, y, lora_b, slots, *(() if order is None else (order,)))
    for name, t in (("out", out), ("y", y), ("lora_b", lora_b)):
        check_last_dim_contiguous(name, t)
    num_slices, num_tokens, rank = y.shape
    if num_slices > 3:
        raise ValueError(f"the expand kernel takes 1 to 3 slices, got {num_slices}")
    if num_tokens == 0 or num_slices == 0:
        return None
    n = out.shape[1]
    cfg = {**expand_config(num_tokens, rank, out.dtype), **(config or {})}
    block_n = cfg["BLOCK_N"]
    ends = tuple(slice_starts[1:]) + (n,)
    n_blocks = [cdiv(end - start, block_n) for start, end in zip(slice_starts, ends)]
    first_blocks = [sum(n_blocks[:i]) if i < num_slices else 1 << 30 for i in (1, 2)]
    pad = (0,) * (3 - num_slices)
    grid = (sum(n_blocks), cdiv(num_tokens, cfg["BLOCK_M"]))
    if grid[0] == 0:
        return None
    is_sorted = _sorted(order, num_tokens, cfg["BLOCK_M"])
    scalars = (num_tokens, rank, *first_blocks, *slice_starts, *pad, *ends, *pad, out.stride(0), y.stride(0),
               y.stride(1), lora_b.stride(0), lora_b.stride(1))
    kwargs = dict(HI_LO=out.dtype != torch.float32, Y_ALIGNED=_is_aligned(y),
                  UPCAST=upcast_dot_operands(out.dtype, out.device), PRECISION=dot_precision(out.dtype),
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n, BLOCK_R=_block_r(rank), SORTED=is_sorted,
                  OUT_FIRST=cfg.get("OUT_FIRST", False), **pdl_options(out.device), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    return grid, scalars, kwargs, is_sorted


def lora_expand_triton(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                       slice_starts: tuple[int, ...], config: dict | None = None,
                       order: torch.Tensor | None = None) -> None:
    """Triton launcher of `lora_expand`; config overrides `expand_config`'s keys; order as `lora_shrink`'s. Its
    checks and launch parameters are worked out once per call signature (`_EXPAND_PLANS`)."""
    starts = tuple(slice_starts)
    key = None  # slice starts that are not all ints (16.0 == 16 as a key) are checked (and refused) below, not cached
    if all(type(s) is int for s in starts):
        key = (_signature(out, y, lora_b, slots, order), y.data_ptr() % 16 == 0, starts, _config_key(config))
    if key is not None and key in _EXPAND_PLANS:
        plan = _EXPAND_PLANS[key]
    else:
        plan = _expand_plan(out, y, lora_b, slots, starts, config, order)
        if key is not None:
            _EXPAND_PLANS[key] = plan
    if plan is None:
        return
    grid, scalars, kwargs, is_sorted = plan
    _lora_expand_kernel[grid](out, y, lora_b, slots, order if is_sorted else slots, *scalars, **kwargs)


def _slots_in_use(slots: torch.Tensor, num_slots: int) -> list[int]:
    """The distinct slots of the batch (a host sync: the references' loop over adapters)."""
    used = [int(s) for s in torch.unique(slots).tolist()]
    if used and (used[0] < -1 or used[-1] >= num_slots):
        raise ValueError(f"slots must lie in [-1, {num_slots}), got values in [{used[0]}, {used[-1]}]")
    return [s for s in used if s >= 0]


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Torch reference of `lora_shrink` (and its CPU implementation): a loop over the slots in use, in float32."""
    _check_shrink(x, lora_a, slots)
    num_slices, rank = lora_a.shape[1], lora_a.shape[2]
    y = torch.zeros(num_slices, x.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot in _slots_in_use(slots, lora_a.shape[0]):
        rows = slots == slot
        y[:, rows] = torch.einsum("tk,irk->itr", x[rows].float(), lora_a[slot].float())
    return y


def lora_expand_ref(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                    slice_starts: tuple[int, ...]) -> None:
    """Torch reference of `lora_expand` (and its CPU implementation): per slot in use, every slice's delta in
    float32, added to the rows and rounded once."""
    _check_expand(out, y, lora_b, slots, slice_starts)
    n = out.shape[1]
    bounds = list(zip(slice_starts, tuple(slice_starts[1:]) + (n,)))
    for slot in _slots_in_use(slots, lora_b.shape[0]):
        rows = slots == slot
        delta = torch.zeros(int(rows.sum()), n, dtype=torch.float32, device=out.device)
        for i, (start, end) in enumerate(bounds):
            delta[:, start:end] = y[i, rows] @ lora_b[slot, start:end].float().T
        out[rows] = (out[rows].float() + delta).to(out.dtype)


def _kernel_wanted(tensor: torch.Tensor, use_kernel: bool | None) -> bool:
    return use_triton(tensor) if use_kernel is None else use_kernel


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, *, use_kernel: bool | None = None,
                order: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (model dtype), lora_a [S, n_slices, R, K] (stacked adapter slots; rank padded with zeros to R),
    slots [T] int32 (slot of each token's adapter, -1 = no adapter). Returns y [n_slices, T, R] float32,
    y[i, t] = lora_a[slots[t], i] @ x[t] (zeros where slots[t] == -1).

    use_kernel: None, the Triton kernel for CUDA tensors and the reference elsewhere; True, the kernel (CPU tensors
    under TRITON_INTERPRET=1 too); False, the reference. order: None, or the rows sorted by slot, int32 or int64
    [T] (`torch.argsort(slots)`, a permutation of 0..T-1): the kernel's tiles then take the rows in that order
    (a few slots a tile where a decode batch interleaves adapters); the same y either way, and the reference needs
    none."""
    if _kernel_wanted(x, use_kernel):
        return lora_shrink_triton(x, lora_a, slots, order=order)
    return lora_shrink_ref(x, lora_a, slots)


def lora_expand(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                slice_starts: tuple[int, ...], *, use_kernel: bool | None = None,
                order: torch.Tensor | None = None) -> None:
    """In place: out [T, N] (model dtype) += for each slice i, columns [slice_starts[i], slice_starts[i+1]) (the
    last slice ends at N): y[i] [T, R] @ lora_b[slots[t], cols, :].T, with lora_b [S, N, R] (the adapter's
    scaling already folded into B). Rows with slots[t] == -1 unchanged. Accumulate in float32, one rounding.
    use_kernel and order as `lora_shrink`'s."""
    if _kernel_wanted(out, use_kernel):
        lora_expand_triton(out, y, lora_b, slots, slice_starts, order=order)
    else:
        lora_expand_ref(out, y, lora_b, slots, slice_starts)
