"""Rejection sampling of speculative drafts with a one-hot draft distribution (n-gram / prompt lookup), which keeps
the target's distribution exactly (Leviathan et al. 2023; Chen et al. 2023):

    row r, drafts x_0 .. x_{d-1}, target probabilities p_0 .. p_d (p_j: the distribution of the token after x_{j-1},
    every sampling knob already applied)
    for j < d:  accept x_j with probability p_j(x_j)         (q(x_j) = 1: min(1, p / q) = p)
                on the first rejection: sample from p_j with x_j removed, renormalized, and stop
    all d accepted: a bonus token from p_d

A greedy row's p_j is one-hot at its argmax: a draft is accepted exactly when it equals the argmax, and the token
after the run is the argmax itself. So one rule serves both.

The randomness of row r's position j comes from one 64-bit key, keys[r, j], through kernels/sampling.py's
counter-based hash: the uniform that decides acceptance at counter ACCEPT_COUNTER, and the Gumbel noise of the draw
(argmax of log q + g, the Gumbel-max trick) at counter t for token t. A seeded request's keys depend only on its seed
and positions, so its speculative output is reproducible.

Outputs: tokens [R, K + 1] (the accepted drafts, then the token drawn; -1 past them) and num_accepted [R].
"""

import torch

from kernels.sampling import gumbel_ref

ACCEPT_COUNTER = (1 << 32) - 1  # past any token id: the acceptance uniform's counter


def uniform_ref(keys: torch.Tensor, counter: int) -> torch.Tensor:
    """Uniforms in (0, 1) from keys [...] (int64) at one counter: u = exp(-exp(-g)) of the Gumbel noise g."""
    flat = keys.reshape(-1)
    g = gumbel_ref(flat, torch.full((1, 1), counter, dtype=torch.int64, device=keys.device))[:, 0]
    return torch.exp(-torch.exp(-g)).reshape(keys.shape)


def _check_inputs(probs, draft_ids, num_drafts, keys) -> None:
    if probs.dim() != 3:
        raise ValueError(f"probs must be [rows, K + 1, vocab], got shape {tuple(probs.shape)}")
    rows, positions, _ = probs.shape
    if draft_ids.shape != (rows, positions - 1):
        raise ValueError(f"draft_ids must be [rows={rows}, K={positions - 1}], got {tuple(draft_ids.shape)}")
    if num_drafts.shape != (rows,):
        raise ValueError(f"num_drafts must be [rows={rows}], got {tuple(num_drafts.shape)}")
    if keys.shape != (rows, positions):
        raise ValueError(f"keys must be [rows={rows}, K + 1={positions}], got {tuple(keys.shape)}")
    if probs.dtype != torch.float32:
        raise ValueError(f"probs must be float32, got {probs.dtype}")
    for name, t in (("draft_ids", draft_ids), ("num_drafts", num_drafts), ("keys", keys)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")


def rejection_sample_ref(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                         keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, K + 1, V] float32 (row r's positions past num_drafts[r] + 1 are ignored), draft_ids [R, K] int64
    (padding past num_drafts: any id), num_drafts [R] int64, keys [R, K + 1] int64.
    Returns (tokens [R, K + 1] int64, -1 past the accepted drafts and the drawn token; num_accepted [R] int64)."""
    _check_inputs(probs, draft_ids, num_drafts, keys)
    rows, positions, vocab = probs.shape
    k = positions - 1
    is_draft = torch.arange(k, device=probs.device)[None, :] < num_drafts[:, None]  # [R, K]
    safe_ids = torch.where(is_draft, draft_ids, 0)
    p_draft = probs[:, :k].gather(-1, safe_ids[..., None]).squeeze(-1)  # [R, K]
    accepted = (uniform_ref(keys[:, :k], ACCEPT_COUNTER) < p_draft) & is_draft
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]: the first rejection ends the run
    # The draw at each position: from p with the draft removed (a rejection), or p itself (past the drafts).
    residual = probs.clone()
    residual[:, :k].scatter_(-1, safe_ids[..., None], torch.where(is_draft, 0.0, p_draft)[..., None])
    token_ids = torch.arange(vocab, device=probs.device)[None, :]
    noise = gumbel_ref(keys.reshape(-1), token_ids).reshape(rows, positions, vocab)
    drawn = (residual.log() + noise).argmax(dim=-1)  # [R, K + 1]
    final = drawn.gather(1, num_accepted[:, None])  # [R, 1]
    column = torch.arange(positions, device=probs.device)[None, :]
    padded_drafts = torch.cat([safe_ids, safe_ids[:, :1]], dim=1)
    tokens = torch.where(column < num_accepted[:, None], padded_drafts,
                         torch.where(column == num_accepted[:, None], final, -1))
    return tokens, num_accepted


def greedy_accept_ref(target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows: `rejection_sample_ref` of one-hot targets, without their probabilities. target_ids [R, K + 1]
    (each position's argmax), draft_ids [R, K], num_drafts [R], all int64. Same outputs."""
    rows, positions = target_ids.shape
    if draft_ids.shape != (rows, positions - 1) or num_drafts.shape != (rows,):
        raise ValueError(f"draft_ids must be [{rows}, {positions - 1}] and num_drafts [{rows}], got "
                         f"{tuple(draft_ids.shape)} and {tuple(num_drafts.shape)}")
    k = positions - 1
    is_draft = torch.arange(k, device=target_ids.device)[None, :] < num_drafts[:, None]
    num_accepted = ((target_ids[:, :k] == draft_ids) & is_draft).long().cumprod(dim=1).sum(dim=1)
    column = torch.arange(positions, device=target_ids.device)[None, :]
    return torch.where(column <= num_accepted[:, None], target_ids, -1), num_accepted


def rejection_sample(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `rejection_sample_ref` (the only implementation for now: a Triton kernel is not built)."""
    return rejection_sample_ref(probs, draft_ids, num_drafts, keys)
