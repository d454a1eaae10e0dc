"""Prompt-lookup drafts on the device: the n-gram proposer of engine/spec_decode.py (`NgramProposer`), over the
runner's device token histories (workers/token_history.py), for steps launched before the step in flight is read
back. The same drafts as the host's lookup, from the same tokens: the longest match of the sequence's last n tokens
(n from max_n down to min_n) that ends before its last token, its latest occurrence, and the up to k tokens after it.

    history   t0 t1 ... t(L-1)            (the last step's accepted tokens already appended on the device)
    run[e]    how many tokens end at e and match the sequence's end, up to max_n (e < L - 1)
    best      the largest run * W + e over the ends with run >= min_n: the longest match, then the latest
    drafts    t(best + 1) ... t(best + k), as many as the history holds (`found`), the rest any token

The reference is vectorized over the rows and every end at once (max_n passes of [R, W] compares: some 40 small
kernels on a GPU, each a launch the host pays in a step launched ahead). The Triton kernel is one launch: a program
per row walks its ends in blocks, the max_n compares in registers, and keeps the best score; then it reads the k
tokens after it. Both give the same drafts (integers: exact), and neither reads anything back to the host: the
drafts go straight into the next step's input ids and the verification's draft ids.
"""

from __future__ import annotations

import torch

from kernels._triton import check_launchable, next_power_of_2, pdl_options, tl, triton, use_triton, wait_for_prior

BLOCK = 256


def ngram_lookup_ref(tokens: torch.Tensor, num_tokens: torch.Tensor, k: int, min_n: int, max_n: int,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [R, W] (the rows' histories, W at least each row's length), num_tokens [R] (lengths, on the device).
    Returns (drafts [R, k] int64, found [R] int64: how many of each row's drafts the lookup found, 0..k; the drafts
    past them are padding)."""
    rows, width = tokens.shape
    h = tokens.long()
    n = num_tokens.long()
    ends = torch.arange(width, device=h.device)
    run = torch.ones(rows, width, dtype=torch.bool, device=h.device)
    length = torch.zeros(rows, width, dtype=torch.long, device=h.device)
    for j in range(max_n):  # the run ending at e goes on to j + 1 tokens: t(e - j) == t(L - 1 - j)
        tail_pos = n - 1 - j
        tail = h.gather(1, tail_pos.clamp(min=0)[:, None])
        src = ends - j
        matches = (src >= 0)[None, :] & (h[:, src.clamp(min=0)] == tail) & (tail_pos >= 0)[:, None]
        run &= matches
        length += run
    length = torch.where(ends[None, :] < (n - 1)[:, None], length, 0)  # a match ends before the last token
    score = torch.where(length >= max(min_n, 1), length * width + ends[None, :], -1)
    best = score.max(dim=1).values
    best_end = best.clamp(min=0) % width
    found = torch.where(best >= 0, (n - 1 - best_end).clamp(min=0, max=k), 0)
    index = (best_end[:, None] + 1 + torch.arange(k, device=h.device)[None, :]).clamp(max=width - 1)
    return h.gather(1, index), found


@triton.jit(do_not_specialize=["stride_t", "width"])  # a step's history width picks no new variant
def _ngram_kernel(tokens_ptr, stride_t, num_tokens_ptr, drafts_ptr, found_ptr, width, min_n,
                  K: tl.constexpr, K_POW2: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = tokens_ptr + row * stride_t
    n = tl.load(num_tokens_ptr + row).to(tl.int64)
    best = tl.max(tl.full([BLOCK], -1, tl.int64), 0)
    for start in range(0, n - 1, BLOCK):  # the ends before the last token
        ends = start + tl.arange(0, BLOCK).to(tl.int64)
        run = ends < n - 1
        length = tl.zeros([BLOCK], tl.int64)
        for j in tl.static_range(MAX_N):
            tail_pos = n - 1 - j
            tail = tl.load(base + tl.maximum(tail_pos, 0))
            src = ends - j  # (src >= 0 with ends < n - 1 puts the tail at n - 1 - j >= 1: no check of its own)
            t = tl.load(base + tl.maximum(src, 0), mask=run, other=0)
            run = run & (src >= 0) & (t == tail)
            length += run.to(tl.int64)
        score = tl.where((length >= min_n) & (ends < n - 1), length * width + ends, -1)
        best = tl.maximum(best, tl.max(score, 0))
    best_end = tl.maximum(best, 0) % width
    found = tl.where(best >= 0, tl.minimum(tl.maximum(n - 1 - best_end, 0), K), 0)
    d = tl.arange(0, K_POW2)
    index = tl.minimum(best_end + 1 + d, width - 1)
    drafts = tl.load(base + index, mask=d < K, other=0)
    tl.store(drafts_ptr + row * K + d, drafts.to(tl.int64), mask=d < K)
    tl.store(found_ptr + row, found)


def ngram_lookup_triton(tokens: torch.Tensor, num_tokens: torch.Tensor, k: int, min_n: int, max_n: int,
                        block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `ngram_lookup`: one program per row."""
    check_launchable(tokens, num_tokens)
    if tokens.dim() != 2 or (tokens.shape[1] > 1 and tokens.stride(1) != 1):
        raise ValueError(f"tokens must be [R, W], contiguous in W, got shape {tuple(tokens.shape)}")
    rows, width = tokens.shape
    drafts = torch.empty(rows, k, dtype=torch.int64, device=tokens.device)
    found = torch.empty(rows, dtype=torch.int64, device=tokens.device)
    if rows and k:
        _ngram_kernel[(rows,)](tokens, tokens.stride(0), num_tokens.contiguous(), drafts, found, width, max(min_n, 1),
                               K=k, K_POW2=next_power_of_2(k), MAX_N=max_n, BLOCK=block,
                               **pdl_options(tokens.device))
    elif rows:
        found.zero_()
    return drafts, found


def ngram_lookup(tokens: torch.Tensor, num_tokens: torch.Tensor, k: int, min_n: int, max_n: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """See `ngram_lookup_ref`: the Triton kernel on a GPU, the reference elsewhere."""
    if use_triton(tokens):
        return ngram_lookup_triton(tokens, num_tokens, k, min_n, max_n)
    return ngram_lookup_ref(tokens, num_tokens, k, min_n, max_n)
