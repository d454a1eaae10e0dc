"""Prompt-lookup drafts on the device: the n-gram proposer of engine/spec_decode.py (`NgramProposer`), over the
runner's device token histories (workers/token_history.py), for steps launched before the step in flight is read
back. The same drafts as the host's lookup, from the same tokens: the longest match of the sequence's last n tokens
(n from max_n down to min_n) that ends before its last token, its latest occurrence, and the up to k tokens after it.

    history   t0 t1 ... t(L-1)            (the last step's accepted tokens already appended on the device)
    run[e]    how many tokens end at e and match the sequence's end, up to max_n (e < L - 1)
    best      the largest run * W + e over the ends with run >= min_n: the longest match, then the latest
    drafts    t(best + 1) ... t(best + k), as many as the history holds (`found`), the rest any token

Vectorized over the rows and every end at once (max_n passes of [R, W] compares), no host round trip: the drafts
go straight into the next step's input ids and the verification's draft ids.
"""

from __future__ import annotations

import torch


def ngram_drafts(tokens: torch.Tensor, num_tokens: torch.Tensor, k: int, min_n: int, max_n: int,
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
