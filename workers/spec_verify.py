"""The runner's side of speculative decoding: a step that carries drafts scores 1 + d positions of each speculating
request and keeps what the target agrees with (engine/spec_decode.py has the driver's side).

    flat batch   [a a a a | b | c c c c]         a: prefill, b: plain decode, c: its last token + 3 drafts
    logits for   a's last, b's last, c's 4 positions
    c's position j is sampled as the plain sampler would sample the token after its j-th draft: every knob on the
    target's logits (allowed ids, logit_bias, min_tokens, penalties over prompt + outputs + drafts before j,
    temperature, top-k, top-p, min-p), then kernels/rejection_sampler.py accepts or rejects the drafts (against
    the distributions a draft model drew them from, `VerifyRow.draft_probs`; one-hot otherwise)

The rows without drafts (a, b) are sampled by the plain sampler (workers/sampler.py), with the grammar bitmask where
they have one: a seeded request samples the same tokens whether or not others speculate beside it. Every token is
on the host when the step returns (speculation runs without overlapped steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import GrammarBitmask, Logprobs, ModelRunnerOutput
from kernels.rejection_sampler import greedy_accept_ref, rejection_sample
from workers.grammar_mask import apply_grammar_bitmask
from workers.inputs import to_device
from workers.sampler import (
    SamplingRow,
    SamplingTensors,
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    finish,
    is_plain,
    sample_async,
)

_MAX_KEY = 1 << 62


@dataclass
class VerifyRow:
    """One sampling request of a speculative step: its state (workers/model_runner.py RequestState), its drafts
    (possibly none), its first position's noise key (None: drawn) and the distributions its drafts were drawn from
    ([d, V] float32: a draft model's sampled drafts; None: one-hot, drafts that are a function of the context)."""

    state: object
    drafts: list[int]
    seed_key: int | None
    draft_probs: torch.Tensor | None = None


def logit_indices(counts: list[int], sample_rows: list[int], num_drafts: list[int]) -> np.ndarray:
    """Flat batch indices of the positions scored: the last 1 + d tokens of each sampling row (d its drafts)."""
    ends = np.cumsum(counts) - 1
    lens = np.asarray(num_drafts, dtype=np.int64) + 1
    firsts = ends[np.asarray(sample_rows, dtype=np.int64)] - lens + 1  # each row's first scored position
    run_starts = np.cumsum(lens) - lens  # where each row's run begins in the output
    return np.repeat(firsts - run_starts, lens) + np.arange(int(lens.sum()))


def verify(logits: torch.Tensor, rows: list[VerifyRow], bitmask: GrammarBitmask | None,
           generator: torch.Generator | None = None) -> tuple[list[list[int]], list[list[Logprobs | None]]]:
    """logits [sum(1 + d), V]: each row's positions in order. Returns each row's tokens (its accepted drafts and one
    token of the target's) and their logprobs."""
    starts = np.cumsum([0] + [1 + len(r.drafts) for r in rows])
    tokens: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[Logprobs | None]] = [[] for _ in rows]
    plain = [i for i, r in enumerate(rows) if not r.drafts]
    if plain:
        x = logits[to_device(starts[plain], torch.long, logits.device)].float()
        if bitmask is not None:
            apply_grammar_bitmask(x, bitmask, [rows[i].state.req_id for i in plain])
        plain_rows = [_sampling_row(rows[i], []) for i in plain]
        ids, lps = finish(sample_async(x, plain_rows, generator, in_place=True), plain_rows)
        for i, t, lp in zip(plain, ids, lps):
            tokens[i], logprobs[i] = [t], [lp]
    spec = [i for i, r in enumerate(rows) if r.drafts]
    if spec:
        spec_logits = logits
        if plain:  # (a step of speculating rows only scores nothing else: no gather)
            index = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in spec])
            spec_logits = logits[to_device(index, torch.long, logits.device)]
        raw = spec_logits.float()
        if bitmask is not None:  # each position's mask (the grammar after the drafts before it), as a plain row's
            spans = [(rows[i].state.req_id, starts[i + 1] - starts[i]) for i in spec]
            apply_grammar_bitmask(raw, bitmask, [r for r, n in spans for _ in range(n)],
                                  [j for _, n in spans for j in range(n)])
        spec_tokens, spec_logprobs = _verify_drafts(raw, [rows[i] for i in spec], generator)
        for i, t, lp in zip(spec, spec_tokens, spec_logprobs):
            tokens[i], logprobs[i] = t, lp
    return tokens, logprobs


def _sampling_row(row: VerifyRow, drafts_before: list[int]) -> SamplingRow:
    """The SamplingRow of the token after `drafts_before` (its history holds them; its key follows the position)."""
    state = row.state
    seed = None if row.seed_key is None else (row.seed_key + len(drafts_before)) % _MAX_KEY
    outputs = state.output_token_ids + drafts_before if drafts_before else state.output_token_ids
    return SamplingRow(state.params, state.prompt_token_ids, outputs, seed, 0, state.knobs)


def _verify_drafts(raw: torch.Tensor, rows: list[VerifyRow], generator: torch.Generator | None,
                   ) -> tuple[list[list[int]], list[list[Logprobs | None]]]:
    """raw [P, V]: the rows' 1 + d positions each, raw logits. Greedy rows accept while the argmax equals the draft;
    the others are rejection-sampled (kernels/rejection_sampler.py)."""
    # No knob on any row at any position (min_tokens met at the first one is met at the later ones): the argmax
    # of the raw logits, with no per-position rows and no knob tensors.
    if all(row.state.params.is_greedy and is_plain(_sampling_row(row, [])) for row in rows):
        token_rows = _greedy_accept(raw, rows)
        return token_rows, _position_logprobs(raw, rows, token_rows)
    positions = [_sampling_row(row, row.drafts[:j]) for row in rows for j in range(len(row.drafts) + 1)]
    x = apply_knobs(raw.clone(), positions)
    device, k = raw.device, max(len(row.drafts) for row in rows)
    starts = np.cumsum([0] + [len(row.drafts) + 1 for row in rows])
    out = torch.full((len(rows), k + 1), -1, dtype=torch.int64, device=device)
    for greedy in (True, False):
        sub = [r for r, row in enumerate(rows) if row.state.params.is_greedy == greedy]
        if not sub:
            continue
        draft_ids = to_device([row.drafts + [0] * (k - len(row.drafts)) for row in (rows[r] for r in sub)],
                              torch.long, device)
        num_drafts = to_device([len(rows[r].drafts) for r in sub], torch.long, device)
        # [len(sub), K + 1] -> flat position (past a row's own positions: its last, ignored)
        flat = to_device([[starts[r] + min(j, starts[r + 1] - starts[r] - 1) for j in range(k + 1)] for r in sub],
                         torch.long, device)
        if greedy:
            tokens, _ = greedy_accept_ref(x.argmax(dim=-1)[flat], draft_ids, num_drafts)
        else:
            index = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in sub])
            probs_flat = target_probs(x[to_device(index, torch.long, device)], [positions[i] for i in index])
            first = np.cumsum([0] + [len(rows[r].drafts) + 1 for r in sub])[:-1]
            local = torch.as_tensor([[first[i] + min(j, len(rows[r].drafts)) for j in range(k + 1)]
                                     for i, r in enumerate(sub)], device=device)
            keys = _keys(rows, sub, k, generator).to(device)
            tokens, _ = rejection_sample(probs_flat[local], draft_ids, num_drafts, keys,
                                         _draft_probs([rows[r] for r in sub], k, raw.shape[-1], device))
        out[to_device(sub, torch.long, device)] = tokens
    token_rows = [[t for t in row if t >= 0] for row in out.tolist()]
    return token_rows, _position_logprobs(raw, rows, token_rows)


def _draft_probs(rows: list[VerifyRow], k: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """[R, K, V] float32: each row's draft distributions (one-hot at its drafts where it has none; zeros past its
    drafts), or None when no row has any (every row one-hot: the sampler's default)."""
    if all(row.draft_probs is None for row in rows):
        return None
    q = torch.zeros(len(rows), k, vocab, dtype=torch.float32, device=device)
    for i, row in enumerate(rows):
        d = len(row.drafts)
        if row.draft_probs is not None:
            assert row.draft_probs.shape == (d, vocab), f"draft probabilities {tuple(row.draft_probs.shape)} for {d}"
            q[i, :d] = row.draft_probs
        elif d:
            q[i, torch.arange(d), torch.tensor(row.drafts)] = 1.0
    return q


def _greedy_accept(raw: torch.Tensor, rows: list[VerifyRow]) -> list[list[int]]:
    """Greedy rows without knobs: each row's drafts while they equal the argmax, then the argmax. One copy of the
    index tensors to the device and one of the tokens back."""
    num_rows, k = len(rows), max(len(row.drafts) for row in rows)
    num_drafts = np.fromiter((len(row.drafts) for row in rows), np.int64, num_rows)
    starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    # [R, K + 1] -> flat position (past a row's own positions: its last, ignored), then [R, K] drafts, then [R]
    flat = starts[:, None] + np.minimum(np.arange(k + 1)[None, :], num_drafts[:, None])
    draft_ids = np.zeros((num_rows, k), np.int64)
    for i, row in enumerate(rows):
        draft_ids[i, :len(row.drafts)] = row.drafts
    packed = to_device(np.concatenate([flat.ravel(), draft_ids.ravel(), num_drafts]), torch.long, raw.device)
    flat_t, drafts_t, num_t = packed.split([flat.size, draft_ids.size, num_rows])
    tokens, _ = greedy_accept_ref(raw.argmax(dim=-1)[flat_t.view(num_rows, k + 1)], drafts_t.view(num_rows, k), num_t)
    return [[t for t in row if t >= 0] for row in tokens.tolist()]


def _keys(rows: list[VerifyRow], sub: list[int], k: int, generator: torch.Generator | None) -> torch.Tensor:
    """[len(sub), K + 1] noise keys: a seeded row's follow its positions, the others are drawn."""
    keys = torch.randint(0, _MAX_KEY, (len(sub), k + 1), dtype=torch.int64, generator=generator)
    for i, r in enumerate(sub):
        if rows[r].seed_key is not None:
            keys[i] = torch.tensor([(rows[r].seed_key + j) % _MAX_KEY for j in range(k + 1)])
    return keys


def apply_knobs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The knobs the plain sampler applies before its draw, in its order, in place on x [P, V]: allowed_token_ids,
    logit_bias, min_tokens, penalties (each position's history holds the drafts before it)."""
    apply_allowed_token_ids(x, rows)
    apply_logit_bias(x, rows)
    apply_min_tokens(x, rows)
    apply_penalties(x, rows, SamplingTensors.build(rows, x.shape[1], x.device))
    return x


def target_probs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[P, V] float32: the distribution the plain sampler (kernels/sampling.py) draws each non-greedy row's token
    from, given x after `apply_knobs`: temperature, then top-k, top-p and min-p (their definitions in
    workers/sampler.py)."""
    tensors = SamplingTensors.build(rows, x.shape[1], x.device)
    z = x * tensors.inv_temperature[:, None]
    if tensors.max_top_k or any(row.params.top_p < 1.0 for row in rows):
        z = apply_top_k_top_p(z, tensors.top_k.long(), tensors.top_p)
    if any(row.params.min_p > 0 for row in rows):
        z = apply_min_p(z, tensors.log_min_p.exp())
    return torch.softmax(z, dim=-1)


def _position_logprobs(raw: torch.Tensor, rows: list[VerifyRow], token_rows: list[list[int]],
                       ) -> list[list[Logprobs | None]]:
    """Each kept token's logprob and the top alternatives, from the raw logits of its position (as the plain
    sampler's: before any knob, the top max_k of the rows that asked, each row's first k of them). Every row's
    at once: one copy to the device, one back."""
    out: list[list[Logprobs | None]] = [[None] * len(kept) for kept in token_rows]
    wanted = [i for i, row in enumerate(rows) if row.state.params.logprobs is not None]
    if not wanted:
        return out
    starts = np.cumsum([0] + [len(row.drafts) + 1 for row in rows])
    flat = [int(starts[i]) + j for i in wanted for j in range(len(token_rows[i]))]
    kept_ids = [t for i in wanted for t in token_rows[i]]
    index = to_device(flat + kept_ids, torch.long, raw.device)
    lp = torch.log_softmax(raw[index[:len(flat)]], dim=-1)  # [W, V]
    sampled = lp.gather(-1, index[len(flat):, None]).squeeze(-1)
    max_k = max(rows[i].state.params.logprobs for i in wanted)
    values, ids = lp.topk(max_k, dim=-1) if max_k else (lp[:, :0], lp[:, :0].long())
    sampled_l, ids_l, values_l = sampled.tolist(), ids.tolist(), values.tolist()
    w = 0
    for i in wanted:
        k = rows[i].state.params.logprobs
        for j in range(len(token_rows[i])):
            out[i][j] = Logprobs(sampled_l[w], ids_l[w][:k], values_l[w][:k])
            w += 1
    return out


class VerifiedStep:
    """A speculative step, sampled and on the host already: `result()` as PendingStep's."""

    bitmask_req_ids: list[str] = []

    def __init__(self, output: ModelRunnerOutput | None):
        self._output = output

    def result(self) -> ModelRunnerOutput | None:
        return self._output
