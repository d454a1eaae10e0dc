"""The device's bookkeeping for a step launched before the step in flight is read back (workers/model_runner.py):
each a scatter of a few values a row that torch would issue as some ten small kernels, here one launch.

`fix_up_inputs`: what only the device knows, written into the step's input buffers before its forward.

    fed      input_ids[fed_pos[i]] = prev_tokens[fed_rows[i]]              the token the step before sampled
    drafts   input_ids[draft_pos[i]] = draft_ids[i]                        drafts proposed on the device
    tokens   positions[tok[i]] -= rejected[tok_prev[i]]                    after a verify step in flight: moved
             slot_mapping[tok[i]] = block_tables[tok_rows[i], pos // bs] * bs + pos % bs   back by the drafts
    seqs     seq_lens[seq_rows[i]] -= rejected[seq_prev[i]]                that step rejected

The index vectors come as one tensor, in that order (fed_pos, fed_rows, draft_pos, tok, tok_rows, tok_prev,
seq_rows, seq_prev), as the runner copies them to the device at once. Every entry is independent of the others
(distinct flat positions, distinct rows), so a program takes BLOCK entries of each kind.

`append_tokens`: a step's new tokens onto the token histories (workers/token_history.py): row p's tokens (its kept
ones, then -1) after the `num_tokens[slots[p]]` already there, and the count advanced; a program per row.
"""

from __future__ import annotations

import torch

from kernels._triton import (
    cdiv,
    check_launchable,
    next_power_of_2,
    pdl_options,
    tl,
    triton,
    use_triton,
    wait_for_prior,
)

BLOCK = 128


def fix_up_inputs_ref(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                      prev_tokens: torch.Tensor | None, rejected: torch.Tensor | None, index: torch.Tensor,
                      counts: tuple[int, int, int, int], draft_ids: torch.Tensor) -> None:
    """In place. counts: (fed, drafts, tokens, seqs) entries of `index` (see the module's table); draft_ids [drafts]."""
    n, d, t, m = counts
    fed_pos, fed_rows, draft_pos, tok, tok_rows, tok_prev, seq_rows, seq_prev = index.split([n, n, d, t, t, t, m, m])
    if n:
        input_ids.index_copy_(0, fed_pos, prev_tokens.index_select(0, fed_rows))
    if d:
        input_ids.index_copy_(0, draft_pos, draft_ids)
    if t:
        moved = positions.index_select(0, tok) - rejected.index_select(0, tok_prev)
        positions.index_copy_(0, tok, moved)
        blocks = block_tables[tok_rows, moved // block_size].long()
        slot_mapping.index_copy_(0, tok, blocks * block_size + moved % block_size)
    if m:
        lens = seq_lens.index_select(0, seq_rows) - rejected.index_select(0, seq_prev).to(seq_lens.dtype)
        seq_lens.index_copy_(0, seq_rows, lens)


# A step's counts pick no new variant, nor where its small vectors start (views of the runner's index tensors: a
# pointer's 16-byte alignment would otherwise pick one), nor its block tables' stride and block size (start-up
# compiles it on small dummies: specialized, the runner's first step launched ahead compiled another variant on the
# H100, 2026-12-05).
@triton.jit(do_not_specialize=["stride_tab", "block_size", "n", "d", "t", "m", "prev_ptr", "rejected_ptr", "index_ptr",
                               "draft_ids_ptr"])
def _fix_up_kernel(ids_ptr, pos_ptr, slot_ptr, seq_lens_ptr, tables_ptr, stride_tab, block_size, prev_ptr,
                   rejected_ptr, index_ptr, draft_ids_ptr, n, d, t, m, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    fed = i < n
    p = tl.load(index_ptr + i, mask=fed, other=0)
    r = tl.load(index_ptr + n + i, mask=fed, other=0)
    tl.store(ids_ptr + p, tl.load(prev_ptr + r, mask=fed, other=0), mask=fed)
    drafts = i < d
    p = tl.load(index_ptr + 2 * n + i, mask=drafts, other=0)
    tl.store(ids_ptr + p, tl.load(draft_ids_ptr + i, mask=drafts, other=0), mask=drafts)
    toks = i < t
    base = 2 * n + d
    q = tl.load(index_ptr + base + i, mask=toks, other=0)
    row = tl.load(index_ptr + base + t + i, mask=toks, other=0)
    prev = tl.load(index_ptr + base + 2 * t + i, mask=toks, other=0)
    moved = tl.load(pos_ptr + q, mask=toks, other=0) - tl.load(rejected_ptr + prev, mask=toks, other=0)
    tl.store(pos_ptr + q, moved, mask=toks)
    block = tl.load(tables_ptr + row * stride_tab + moved // block_size, mask=toks, other=0).to(tl.int64)
    tl.store(slot_ptr + q, block * block_size + moved % block_size, mask=toks)
    seqs = i < m
    base += 3 * t
    s = tl.load(index_ptr + base + i, mask=seqs, other=0)
    prev = tl.load(index_ptr + base + m + i, mask=seqs, other=0)
    lens = tl.load(seq_lens_ptr + s, mask=seqs, other=0) - tl.load(rejected_ptr + prev, mask=seqs, other=0)
    tl.store(seq_lens_ptr + s, lens.to(seq_lens_ptr.dtype.element_ty), mask=seqs)


def fix_up_inputs_triton(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                         seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                         prev_tokens: torch.Tensor | None, rejected: torch.Tensor | None, index: torch.Tensor,
                         counts: tuple[int, int, int, int], draft_ids: torch.Tensor, block: int = BLOCK) -> None:
    """Triton launcher of `fix_up_inputs`: one launch, BLOCK entries of each kind a program."""
    n, d, t, m = counts
    if (n and prev_tokens is None) or ((t or m) and rejected is None):
        raise ValueError("fed tokens need prev_tokens, moved tokens and sequences need rejected")
    prev_tokens = input_ids if prev_tokens is None else prev_tokens  # (not read without entries)
    rejected = positions if rejected is None else rejected
    check_launchable(input_ids, positions, slot_mapping, seq_lens, block_tables, prev_tokens, rejected, index,
                     draft_ids)
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    most = max(counts)
    if most:
        _fix_up_kernel[(cdiv(most, block),)](input_ids, positions, slot_mapping, seq_lens, block_tables,
                                             block_tables.stride(0), block_size, prev_tokens, rejected, index,
                                             draft_ids, n, d, t, m, BLOCK=block, **pdl_options(input_ids.device))


def fix_up_inputs(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  prev_tokens: torch.Tensor | None, rejected: torch.Tensor | None, index: torch.Tensor,
                  counts: tuple[int, int, int, int], draft_ids: torch.Tensor) -> None:
    """See the module's table: the Triton kernel on a GPU where there are drafts or moved rows (some ten torch
    kernels), the reference elsewhere and for the fed tokens alone (every overlapped decode step's: two torch
    kernels, no dearer to launch than one Triton kernel)."""
    n, d, t, m = counts
    fix = fix_up_inputs_triton if use_triton(input_ids) and (d or t or m) else fix_up_inputs_ref
    fix(input_ids, positions, slot_mapping, seq_lens, block_tables, block_size, prev_tokens, rejected, index, counts,
        draft_ids)


def append_tokens_ref(tokens: torch.Tensor, num_tokens: torch.Tensor, slots: torch.Tensor, new: torch.Tensor,
                      rows: torch.Tensor | None = None) -> None:
    """tokens [S, max_len + 1] int32 (the last column: where padding goes), num_tokens [S]; slots [P] (distinct),
    new [R, W] (each row's new tokens, then -1), rows [P]: the row of `new` for each slot (default 0..P-1). In
    place: the kept tokens after each slot's filled length (past max_len: dropped), the lengths advanced."""
    if rows is not None:
        new = new.index_select(0, rows)
    max_len = tokens.shape[1] - 1
    ends = num_tokens[slots]
    kept = new >= 0
    cols = ends[:, None] + torch.arange(new.shape[1], device=new.device)[None, :]
    cols = torch.where(kept & (cols < max_len), cols, max_len)
    tokens[slots[:, None].expand_as(cols), cols] = new.to(tokens.dtype)
    num_tokens[slots] = ends + kept.sum(dim=1)


# nor its widths, views, nor its histories' length and stride (start-up compiles it on a 2 x 9 dummy: specialized,
# a plain engine's first penalized step compiled another variant on the H100, 2026-12-05)
@triton.jit(do_not_specialize=["stride_t", "stride_new", "width", "max_len", "slots_ptr", "rows_ptr", "new_ptr"])
def _append_kernel(tokens_ptr, stride_t, num_tokens_ptr, slots_ptr, new_ptr, stride_new, rows_ptr, width, max_len,
                   HAS_ROWS: tl.constexpr, W_POW2: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    p = tl.program_id(0)
    slot = tl.load(slots_ptr + p).to(tl.int64)
    row = p.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + p).to(tl.int64)
    end = tl.load(num_tokens_ptr + slot).to(tl.int64)
    w = tl.arange(0, W_POW2)
    new = tl.load(new_ptr + row * stride_new + w, mask=w < width, other=-1)
    kept = new >= 0
    cols = end + w
    tl.store(tokens_ptr + slot * stride_t + cols, new.to(tokens_ptr.dtype.element_ty), mask=kept & (cols < max_len))
    tl.store(num_tokens_ptr + slot, end + tl.sum(kept.to(tl.int64), 0))


def append_tokens_triton(tokens: torch.Tensor, num_tokens: torch.Tensor, slots: torch.Tensor, new: torch.Tensor,
                         rows: torch.Tensor | None = None) -> None:
    """Triton launcher of `append_tokens`: a program per slot, one variant for every width up to 8 (a plain step's
    1, a verify step's k + 1). (It leaves the padding column alone, which the reference writes: nothing reads it.)"""
    check_launchable(tokens, num_tokens, slots, new, *(() if rows is None else (rows,)))
    if tokens.stride(1) != 1 or (new.shape[1] > 1 and new.stride(1) != 1):
        raise ValueError("tokens and new must be contiguous in their last dimension")
    if slots.numel():
        _append_kernel[(slots.numel(),)](tokens, tokens.stride(0), num_tokens, slots, new, new.stride(0),
                                         slots if rows is None else rows, new.shape[1], tokens.shape[1] - 1,
                                         HAS_ROWS=rows is not None, W_POW2=max(8, next_power_of_2(new.shape[1])),
                                         **pdl_options(tokens.device))


def append_tokens(tokens: torch.Tensor, num_tokens: torch.Tensor, slots: torch.Tensor, new: torch.Tensor,
                  rows: torch.Tensor | None = None) -> None:
    """See `append_tokens_ref`: the Triton kernel on a GPU, the reference elsewhere."""
    (append_tokens_triton if use_triton(tokens) else append_tokens_ref)(tokens, num_tokens, slots, new, rows)


def warm_up_run_ahead(device: torch.device, history: bool, ngram: tuple[int, int] | None, k: int) -> None:
    """Compiles, on a few dummy values, the kernels a runner will launch (`history`: it keeps token histories;
    ngram: (min_n, max_n) of its device lookup, with k drafts), not in the first step that needs them. Their
    counts and widths pick no new variant later (do_not_specialize; the append's widths up to 8 share one)."""
    if not use_triton(torch.empty(0, device=device)):
        return
    longs = [torch.zeros(8, dtype=torch.int64, device=device) for _ in range(6)]
    if history:
        append_tokens(torch.zeros(2, 9, dtype=torch.int32, device=device), longs[0][:2], longs[1][:1],
                      torch.full((1, 2), -1, dtype=torch.int64, device=device), longs[2][:1])
    if ngram is not None:
        from kernels.ngram import ngram_lookup

        ngram_lookup(torch.zeros(1, 8, dtype=torch.int32, device=device), longs[3][:1] + 4, k, *ngram)
        seq_lens, tables = (torch.zeros(2, dtype=torch.int32, device=device),
                            torch.zeros(2, 2, dtype=torch.int32, device=device))
        fix_up_inputs(longs[0], longs[1], longs[2], seq_lens, tables, 4, longs[3], longs[4], longs[5],
                      (1, 1, 1, 1), longs[5][:1])
