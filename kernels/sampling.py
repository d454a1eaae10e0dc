"""One token per row of float32 logits, drawn without sorting the vocabulary.

Each row has its own knobs. With z = x * inv_temperature:

    candidates   x >= kth                        top-k (kth: the row's k-th largest logit; -inf: every token)
                 z >= max(z) + log_min_p         min-p, relative to the most likely token (-inf: off)
    nucleus      mass of the tokens above t      top-p over the top-k candidates, renormalized: t stays while the
                 (larger z) < top_p              probability of the tokens ranked above it is below top_p

The draw is the Gumbel-max trick: the argmax over the candidates of z + g, g = -log(-log u), picks t with probability
softmax(z)[t]. u comes from a counter-based hash of (the row's 64-bit key, the round, the token id), so a key gives the
same token whatever else is in the batch, on any device (the reference computes the very same bits). A row with
noise_scale 0 is greedy: the first argmax.

Top-p by rejection, no sort: a drawn token outside the nucleus becomes the pivot (every token with a smaller z is
outside too) and the row draws again among the tokens above it. The nucleus always lies above the pivot, so the
token accepted follows the nucleus' renormalized distribution exactly, and each round accepts with probability at
least top_p (usually far more: a rejection cuts the candidates below a random one). The last of MAX_ROUNDS rounds
takes the argmax, which is always in the nucleus. The most likely token always is (nothing lies above it), also at a
top_p that float32 rounds to 0 (a request's 5e-324 is valid): such a row is greedy.

A top-k row reads only its largest logits when given them (`subset`, from torch.topk) and they hold all of its
candidates, i.e. the ties at the k-th logit do not run past them; the noise follows token ids, so the draw is the one
the whole row gives. Other rows, and the rows whose ties run past, read the whole row.

    per round   draw: argmax over the row (one read of it)
                top-p rows: the mass above the drawn token (one more read; max and sum computed online)
    min-p rows  one read first, for the max
"""

import torch

from kernels._triton import (
    check_dtype,
    check_launchable,
    next_power_of_2,
    pdl_options,
    tl,
    triton,
    use_triton,
    wait_for_prior,
)

BLOCK = 2048
SUB_BLOCK = 128  # a top-k row's subset, this many columns a load (top_k up to 96 in one)
MAX_ROUNDS = 32
_MASK32 = 0xFFFFFFFF
_U24 = 5.960464477539063e-08  # 2 ** -24


@triton.jit
def _hash32(x):
    """lowbias32 (C. Wellons' hash prospector): a uint32 -> uint32 hash with full avalanche."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel(key_lo, key_hi, counter):
    h = _hash32(_hash32(counter ^ key_lo) + key_hi)
    u = ((h >> 8).to(tl.float32) + 0.5) * 5.960464477539063e-08  # in (0, 1), 24 random bits
    return -tl.log(-tl.log(u))


@triton.jit
def _row_max(base, num_cols, inv_t, kth, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, num_cols, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < num_cols, other=float("-inf"))
        best = tl.maximum(best, tl.where((idx < num_cols) & (x >= kth), x * inv_t, float("-inf")))
    return tl.max(best, 0)


@triton.jit
def _draw(base, ids_base, num_cols, inv_t, kth, floor, pivot, noise, key_lo, key_hi, counter0,
          HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """The column of the first argmax of z + noise * gumbel over the candidates with z > pivot."""
    cols = tl.arange(0, BLOCK)
    best_q = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_cols, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < num_cols, other=float("-inf"))
        z = x * inv_t
        ok = (idx < num_cols) & (x >= kth) & (z >= floor) & (z > pivot)
        token = idx
        if HAS_IDS:
            token = tl.load(ids_base + idx, mask=idx < num_cols, other=0).to(tl.int32)
        g = _gumbel(key_lo, key_hi, (counter0 + token).to(tl.uint32))  # noise follows the token, not the column
        q = tl.where(ok, z + noise * g, float("-inf"))
        better = q > best_q  # strict: a lane keeps its first maximum
        best_i = tl.where(better, idx, best_i)
        best_q = tl.where(better, q, best_q)
    top = tl.max(best_q, 0)
    return tl.min(tl.where(best_q == top, best_i, num_cols), 0)


@triton.jit
def _mass_above(base, num_cols, inv_t, kth, z_t, BLOCK: tl.constexpr):
    """Probability of the top-k candidates with z > z_t, renormalized over the candidates (online softmax)."""
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.zeros([BLOCK], tl.float32)
    above = tl.zeros([BLOCK], tl.float32)
    for start in range(0, num_cols, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < num_cols, other=float("-inf"))
        z = tl.where((idx < num_cols) & (x >= kth), x * inv_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf: nothing seen yet weighs 0
        alpha = tl.exp(m - shift)
        p = tl.exp(z - shift)
        total = total * alpha + p
        above = above * alpha + tl.where(z > z_t, p, 0.0)
        m = m_new
    return tl.sum(above, 0) / tl.sum(total, 0)


@triton.jit
def _sample_row(base, ids_base, num_cols, vocab, inv_t, kth, top_p, log_min_p, noise, key_lo, key_hi,
                HAS_IDS: tl.constexpr, BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    """The token id (int64) drawn from one row's columns, which hold all of its candidates."""
    floor = log_min_p  # -inf: no min-p
    if log_min_p > float("-inf"):
        floor = _row_max(base, num_cols, inv_t, kth, BLOCK) + log_min_p
    pivot = tl.max(tl.full([1], float("-inf"), tl.float32), 0)
    column = tl.min(tl.zeros([1], tl.int32), 0)
    done = tl.min(tl.zeros([1], tl.int32), 0)
    for r in range(MAX_ROUNDS):
        if done == 0:
            is_last = r == MAX_ROUNDS - 1
            column = _draw(base, ids_base, num_cols, inv_t, kth, floor, pivot, tl.where(is_last, 0.0, noise),
                           key_lo, key_hi, r * vocab, HAS_IDS, BLOCK)
            pivot = tl.load(base + column) * inv_t
            done = 1
            if (top_p < 1.0) & (r < MAX_ROUNDS - 1):
                mass = _mass_above(base, num_cols, inv_t, kth, pivot, BLOCK)
                if (mass >= top_p) & (mass > 0.0):  # the most likely token stays, even at a top_p of 0
                    done = 0  # outside the nucleus: it is the new pivot
    token = column.to(tl.int64)
    if HAS_IDS:
        token = tl.load(ids_base + column)
    return token


# One compiled variant per HAS_SUBSET, whatever the batch and its top-k: the subset's width (a request's top_k plus a
# margin) is not specialized on and is read SUB_BLOCK columns at a time. Each variant compiled while requests wait
# cost 0.5-0.7 s of an H200 step loop (workers/worker.py compiles both at start-up).
@triton.jit(do_not_specialize=["stride_sub", "stride_ids", "num_sub"])
def _sample_kernel(x_ptr, stride_x, sub_ptr, stride_sub, ids_ptr, stride_ids, out_ptr, inv_temp_ptr, kth_ptr,
                   top_p_ptr, log_min_p_ptr, noise_ptr, key_ptr, vocab, num_sub, HAS_SUBSET: tl.constexpr,
                   BLOCK: tl.constexpr, SUB_BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_base = x_ptr + row * stride_x
    inv_t = tl.load(inv_temp_ptr + row)
    kth = tl.load(kth_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    log_min_p = tl.load(log_min_p_ptr + row)
    noise = tl.load(noise_ptr + row)
    key = tl.load(key_ptr + row)
    key_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    if HAS_SUBSET:
        sub_base = sub_ptr + row * stride_sub
        ids_base = ids_ptr + row * stride_ids
        if tl.load(sub_base + num_sub - 1) < kth:  # every candidate (x >= kth) is in the subset: read only it
            token = _sample_row(sub_base, ids_base, num_sub, vocab, inv_t, kth, top_p, log_min_p, noise, key_lo,
                                key_hi, True, SUB_BLOCK, MAX_ROUNDS)
        else:  # no top-k, or ties at the k-th logit run past the subset
            token = _sample_row(x_base, x_base, vocab, vocab, inv_t, kth, top_p, log_min_p, noise, key_lo, key_hi,
                                False, BLOCK, MAX_ROUNDS)
    else:
        token = _sample_row(x_base, x_base, vocab, vocab, inv_t, kth, top_p, log_min_p, noise, key_lo, key_hi,
                            False, BLOCK, MAX_ROUNDS)
    tl.store(out_ptr + row, token)


def _check_inputs(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, vocab], got shape {tuple(x.shape)}")
    check_dtype("x", x, (torch.float32,))
    for name, t in (("inv_temperature", inv_temperature), ("kth", kth), ("top_p", top_p),
                    ("log_min_p", log_min_p), ("noise_scale", noise_scale)):
        if t.shape != (x.shape[0],):
            raise ValueError(f"{name} must be [rows={x.shape[0]}], got {tuple(t.shape)}")
        check_dtype(name, t, (torch.float32,))
    if keys.shape != (x.shape[0],):
        raise ValueError(f"keys must be [rows={x.shape[0]}], got {tuple(keys.shape)}")
    check_dtype("keys", keys, (torch.int64,))
    if subset is not None:
        values, ids = subset
        if values.dim() != 2 or values.shape[0] != x.shape[0] or ids.shape != values.shape or values.shape[1] < 1:
            raise ValueError(f"subset must be (values, ids) of one shape [rows={x.shape[0]}, S >= 1], got "
                             f"{tuple(values.shape)} and {tuple(ids.shape)}")
        check_dtype("subset values", values, (torch.float32,))
        check_dtype("subset ids", ids, (torch.int64,))


def sample_triton(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset=None, block: int = BLOCK,
                  max_rounds: int = MAX_ROUNDS):
    """Triton launcher of `sample_tokens`: one program per row, which streams its row (or its subset) once per
    pass."""
    _check_inputs(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset)
    check_launchable(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys)
    values, ids = subset if subset is not None else (x, x)  # placeholders when absent
    for name, t in (("x", x), ("subset values", values), ("subset ids", ids)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")
    scalars = [t.contiguous() for t in (inv_temperature, kth, top_p, log_min_p, noise_scale, keys)]
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        block = min(block, next_power_of_2(vocab))
        _sample_kernel[(rows,)](x, x.stride(0), values, values.stride(0), ids, ids.stride(0), out, *scalars, vocab,
                                values.shape[1], HAS_SUBSET=subset is not None, BLOCK=block,
                                SUB_BLOCK=min(block, SUB_BLOCK), MAX_ROUNDS=max_rounds,
                                **pdl_options(x.device), num_warps=max(1, min(8, block // 256)))
    return out


def _hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """`_hash32` on int64 tensors holding uint32 values: the same bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x < 2^32 with no int64 overflow: c's top bit only adds (x & 1) << 31."""
    if c >> 31:
        return (x * (c & 0x7FFFFFFF) + ((x & 1) << 31)) & _MASK32
    return (x * c) & _MASK32


def gumbel_ref(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [R, C] of row keys [R] (int64) at counters [R or 1, C]: the kernel's `_gumbel`, the same bits
    up to the rounding of the two logarithms."""
    key_lo, key_hi = (keys & _MASK32)[:, None], ((keys >> 32) & _MASK32)[:, None]
    h = _hash32_ref((_hash32_ref(counters ^ key_lo) + key_hi) & _MASK32)
    u = ((h >> 8).to(torch.float32) + 0.5) * _U24
    return -torch.log(-torch.log(u))


def sample_ref(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset=None,
               max_rounds: int = MAX_ROUNDS):
    """Torch reference of `sample_tokens` (and its CPU implementation): the kernel's rounds, each over the rows
    that have not accepted a token yet; over the subset when it holds every row's candidates."""
    _check_inputs(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset)
    rows, vocab = x.shape
    ids = torch.arange(vocab, device=x.device)[None, :]  # the token id of each column worked on: [1 or R, C]
    if subset is not None and rows and bool((subset[0][:, -1] < kth).all()):
        x, ids = subset
    z = x * inv_temperature[:, None]
    z_k = torch.where(x >= kth[:, None], z, float("-inf"))  # the top-k candidates
    row_max = z_k.max(dim=-1, keepdim=True).values
    floor = row_max + log_min_p[:, None]  # -inf without min-p
    p_k = torch.exp(z_k - row_max)  # unnormalized candidate probabilities (0 off the candidates)
    total = p_k.sum(dim=-1)
    token = torch.zeros(rows, dtype=torch.int64, device=x.device)
    pivot = torch.full((rows, 1), float("-inf"), device=x.device)
    active = torch.arange(rows, device=x.device)
    for r in range(max_rounds):
        is_last = r == max_rounds - 1
        z_a, zk_a, ids_a = z[active], z_k[active], ids[active] if ids.shape[0] > 1 else ids
        noise = noise_scale[active] * (0.0 if is_last else 1.0)
        g = gumbel_ref(keys[active], ids_a + r * vocab)
        q = torch.where((zk_a >= floor[active]) & (zk_a > pivot[active]), z_a + noise[:, None] * g, float("-inf"))
        drawn = q.argmax(dim=-1, keepdim=True)
        z_t = z_a.gather(1, drawn)
        token[active] = ids_a.expand_as(z_a).gather(1, drawn).squeeze(1)
        pivot[active] = z_t
        if is_last:
            break
        mass_above = (p_k[active] * (zk_a > z_t)).sum(dim=-1) / total[active]
        outside = (mass_above >= top_p[active]) & (mass_above > 0)  # the most likely token stays, even at 0
        active = active[(top_p[active] < 1.0) & outside]  # outside the nucleus: again
        if active.numel() == 0:
            break
    return token


def sample_tokens(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset=None):
    """One token id per row of logits x [R, V] (float32): see the module docstring for the knobs.

    inv_temperature, kth, top_p, log_min_p, noise_scale: float32 [R]; keys: int64 [R] (a row's noise depends only
    on its key). Greedy rows: noise_scale 0 (with inv_temperature 1, kth and log_min_p -inf, top_p 1).
    subset: (values, ids) [R, S], each row's S largest logits in descending order and their token ids
    (torch.topk): a row whose last subset value is below its kth has all of its candidates there and reads only
    them, drawing the very token the whole row would give (the noise follows token ids)."""
    if use_triton(x):
        return sample_triton(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset)
    return sample_ref(x, inv_temperature, kth, top_p, log_min_p, noise_scale, keys, subset)
