"""Rejection sampling of speculative drafts, which keeps the target's distribution exactly (Leviathan et al. 2023;
Chen et al. 2023):

    row r, drafts x_0 .. x_{d-1} drawn from draft distributions q_0 .. q_{d-1}, target probabilities p_0 .. p_d (p_j:
    the distribution of the token after x_{j-1}, every sampling knob already applied)
    for j < d:  accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
                on the first rejection: sample from max(p_j - q_j, 0), renormalized, and stop
    all d accepted: a bonus token from p_d

Without q (`draft_probs` None) each q_j is one-hot at x_j (n-gram drafts, a draft model's greedy ones): x_j is
accepted with probability p_j(x_j), and the residual is p_j with x_j removed. A greedy row's p_j is one-hot at its
argmax: a draft is accepted exactly when it equals the argmax, and the token after the run is the argmax itself,
whatever q is. So one rule serves every row.

The randomness of row r's position j comes from one 64-bit key, keys[r, j], through kernels/sampling.py's
counter-based hash: the uniform that decides acceptance at counter ACCEPT_COUNTER (24 bits, the very uniform the
Gumbel noise is made of), and the Gumbel noise of the draw (argmax of log r + g, the Gumbel-max trick) at counter t
for token t. A seeded request's keys depend only on its seed and positions, so its speculative output is
reproducible. The kernel and the reference compute the same bits (the draw's logarithms up to rounding). (The draft
sampled from q must use noise of its own: workers/draft_runner.py salts its keys.)

    per row (one program)   the accept loop: K loads of one probability each (and of q)
                            the draw: one pass over the vocabulary at the first rejected position (or the bonus one)

Outputs: tokens [R, K + 1] (the accepted drafts, then the token drawn; -1 past them) and num_accepted [R].
"""

import torch

from kernels._triton import check_launchable, next_power_of_2, pdl_options, tl, triton, use_triton, wait_for_prior
from kernels.sampling import _MASK32, _U24, _gumbel, _hash32, _hash32_ref, gumbel_ref

ACCEPT_COUNTER = 0x7FFFFFFF  # past any token id: the acceptance uniform's counter
BLOCK = 2048
KMAX = 16  # the kernel's bound on a step's drafts a row: one variant for K up to it (more: the next power of two)


def uniform_ref(keys: torch.Tensor, counter: int) -> torch.Tensor:
    """Uniforms in (0, 1) (24 random bits) from keys [...] (int64) at one counter: the u of kernels/sampling.py's
    Gumbel noise."""
    key_lo, key_hi = keys & _MASK32, (keys >> 32) & _MASK32
    h = _hash32_ref((_hash32_ref(counter ^ key_lo) + key_hi) & _MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) * _U24


@triton.jit
def _uniform(key_lo, key_hi, counter):
    h = _hash32(_hash32(counter ^ key_lo) + key_hi)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.960464477539063e-08


# One variant for every step's K (its most drafts, which varies step to step): K is a runtime bound under the
# constexpr KMAX, and the strides that follow K are not specialized (a step whose K was new compiled 0.4-0.7 s in
# the middle of serving: tests/gpu/test_warm_up_gpu.py). probs and q are contiguous, so a position's row starts at a
# multiple of the vocabulary's stride, whose alignment keeps the vocabulary loop's loads wide.
@triton.jit(do_not_specialize=["k", "stride_d", "stride_key", "stride_out"])
def _rejection_kernel(probs_ptr, stride_pk, q_ptr, stride_qk, draft_ptr, stride_d, num_drafts_ptr, key_ptr,
                      stride_key, out_ptr, stride_out, num_accepted_ptr, vocab, k, KMAX: tl.constexpr,
                      POSITIONS: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    num_drafts = tl.load(num_drafts_ptr + row).to(tl.int32)
    accept_counter = (tl.zeros([1], tl.int32) + 0x7FFFFFFF).to(tl.uint32)
    accepted = tl.min(tl.zeros([1], tl.int32), 0)
    going = tl.min(tl.zeros([1], tl.int32), 0) + 1
    p_row = row * (k + 1)  # probs' position rows: K + 1 a row; q's: K
    q_row = row * k
    for j in tl.static_range(KMAX):
        if (going == 1) & (j < num_drafts):
            draft = tl.load(draft_ptr + row * stride_d + j)
            p = tl.load(probs_ptr + (p_row + j) * stride_pk + draft)
            key = tl.load(key_ptr + row * stride_key + j)
            key_lo = (key & 0xFFFFFFFF).to(tl.uint32)
            key_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
            u = tl.max(_uniform(key_lo, key_hi, accept_counter), 0)
            if HAS_Q:  # u < p / q, q > 0 (the draft was drawn from it)
                u = u * tl.load(q_ptr + (q_row + j) * stride_qk + draft)
            if u < p:
                accepted += 1
            else:
                going = 0
    # The draw at the first rejected position (its draft removed), or the bonus position after all of them.
    key = tl.load(key_ptr + row * stride_key + accepted)
    key_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    rejected = accepted < num_drafts
    removed = tl.load(draft_ptr + row * stride_d + accepted, mask=rejected, other=-1)
    base = probs_ptr + (p_row + accepted) * stride_pk
    q_base = q_ptr + (q_row + accepted) * stride_qk
    q_cols = tl.where(rejected, vocab, 0)  # q's row past the drafts (all accepted) does not exist: no load
    cols = tl.arange(0, BLOCK)
    best_s = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        p = tl.load(base + idx, mask=idx < vocab, other=0.0)
        if HAS_Q:  # the residual max(p - q, 0) at a rejected position
            q = tl.load(q_base + idx, mask=idx < q_cols, other=0.0)
            p = tl.maximum(p - q, 0.0)
        else:
            p = tl.where(idx == removed, 0.0, p)
        g = _gumbel(key_lo, key_hi, idx.to(tl.uint32))
        score = tl.where((p > 0.0) & (idx < vocab), tl.log(tl.where(p > 0.0, p, 1.0)) + g, float("-inf"))
        better = score > best_s  # strict: a lane keeps its first maximum
        best_i = tl.where(better, idx, best_i)
        best_s = tl.where(better, score, best_s)
    top = tl.max(best_s, 0)
    drawn = tl.min(tl.where(best_s == top, best_i, vocab), 0)
    drawn = tl.where(top == float("-inf"), 0, drawn)  # nothing left to draw: as torch's argmax of all -inf
    positions = tl.arange(0, POSITIONS)
    drafts = tl.load(draft_ptr + row * stride_d + positions, mask=positions < accepted, other=0)
    tokens = tl.where(positions < accepted, drafts, tl.where(positions == accepted, drawn.to(tl.int64), -1))
    tl.store(out_ptr + row * stride_out + positions, tokens, mask=positions < k + 1)
    tl.store(num_accepted_ptr + row, accepted.to(tl.int64))


def _check_inputs(probs, draft_ids, num_drafts, keys, draft_probs=None) -> None:
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
    if draft_probs is not None and (draft_probs.shape != (rows, positions - 1, probs.shape[2])
                                    or draft_probs.dtype != torch.float32):
        raise ValueError(f"draft_probs must be float32 [rows={rows}, K={positions - 1}, vocab={probs.shape[2]}], "
                         f"got {draft_probs.dtype} {tuple(draft_probs.shape)}")


def rejection_sample_ref(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                         keys: torch.Tensor, draft_probs: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, K + 1, V] float32 (row r's positions past num_drafts[r] + 1 are ignored), draft_ids [R, K] int64
    (padding past num_drafts: any id), num_drafts [R] int64, keys [R, K + 1] int64, draft_probs: None (one-hot
    drafts) or [R, K, V] float32, the distributions the drafts were drawn from (q_j(x_j) > 0).
    Returns (tokens [R, K + 1] int64, -1 past the accepted drafts and the drawn token; num_accepted [R] int64)."""
    _check_inputs(probs, draft_ids, num_drafts, keys, draft_probs)
    rows, positions, vocab = probs.shape
    k = positions - 1
    is_draft = torch.arange(k, device=probs.device)[None, :] < num_drafts[:, None]  # [R, K]
    safe_ids = torch.where(is_draft, draft_ids, 0)
    p_draft = probs[:, :k].gather(-1, safe_ids[..., None]).squeeze(-1)  # [R, K]
    u = uniform_ref(keys[:, :k], ACCEPT_COUNTER)
    if draft_probs is not None:  # u < p / q
        u = u * draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1)
    accepted = (u < p_draft) & is_draft
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]: the first rejection ends the run
    # The draw at each position: from the residual max(p - q, 0) (a rejection), or p itself (past the drafts).
    residual = probs.clone()
    if draft_probs is None:  # q one-hot: p with the draft removed
        residual[:, :k].scatter_(-1, safe_ids[..., None], torch.where(is_draft, 0.0, p_draft)[..., None])
    else:
        residual[:, :k] = torch.where(is_draft[..., None], (probs[:, :k] - draft_probs).clamp(min=0.0),
                                      probs[:, :k])
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


def rejection_sample_triton(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                            keys: torch.Tensor, draft_probs: torch.Tensor | None = None, block: int = BLOCK,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `rejection_sample`: one program per row."""
    _check_inputs(probs, draft_ids, num_drafts, keys, draft_probs)
    check_launchable(probs, draft_ids, num_drafts, keys, *(() if draft_probs is None else (draft_probs,)))
    if (draft_ids.shape[1] > 1 and draft_ids.stride(1) != 1) or keys.stride(1) != 1:
        raise ValueError("draft_ids and keys must be contiguous in their last dimension")
    probs = probs.contiguous()
    rows, positions, vocab = probs.shape
    tokens = torch.empty(rows, positions, dtype=torch.int64, device=probs.device)
    num_accepted = torch.empty(rows, dtype=torch.int64, device=probs.device)
    q = probs if draft_probs is None else draft_probs.contiguous()  # (not read without HAS_Q)
    k = positions - 1
    kmax = max(KMAX, next_power_of_2(k))
    if rows:
        _rejection_kernel[(rows,)](probs, probs.stride(1), q, q.stride(1), draft_ids, draft_ids.stride(0),
                                   num_drafts.contiguous(), keys, keys.stride(0), tokens, tokens.stride(0),
                                   num_accepted, vocab, k, KMAX=kmax, POSITIONS=next_power_of_2(kmax + 1),
                                   HAS_Q=draft_probs is not None, BLOCK=min(block, next_power_of_2(vocab)),
                                   **pdl_options(probs.device))
    return tokens, num_accepted


def rejection_sample(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     keys: torch.Tensor, draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `rejection_sample_ref`: the Triton kernel on a GPU, the reference elsewhere."""
    if use_triton(probs):
        return rejection_sample_triton(probs, draft_ids, num_drafts, keys, draft_probs)
    return rejection_sample_ref(probs, draft_ids, num_drafts, keys, draft_probs)


def warm_up_rejection(vocab_size: int, device: torch.device, draft_probs: bool) -> None:
    """Compiles the rejection sampling kernel now, not in the first verify step with a sampled row: its variant
    for one-hot drafts (the n-gram proposer's) and, for a draft model, the one with draft distributions. One each,
    whatever a step's rows and most drafts a row (K under KMAX)."""
    if not use_triton(torch.empty(0, device=device)):
        return
    probs = torch.full((1, 2, vocab_size), 1.0 / vocab_size, device=device)
    args = (probs, torch.zeros(1, 1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int64, device=device),
            torch.zeros(1, 2, dtype=torch.int64, device=device))
    rejection_sample(*args)
    if draft_probs:
        rejection_sample(*args, probs[:, :1].contiguous())
