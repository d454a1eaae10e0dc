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
on the host when the step's `result()` returns: the step is launched without a wait, and the driver reads it back
before it launches the next (engine/llm_engine.py: the drafts of the next step need its tokens).
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
    SampledBatch,
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
    penalty_batch,
    sample_async,
    shift_keys,
)
from workers.token_history import PenaltyBatch

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
    token of the target's) and their logprobs: `launch_verify`, then its tokens read back."""
    launched = launch_verify(logits, rows, bitmask, generator)
    token_rows = kept_tokens(launched.tokens.tolist())
    return token_rows, launched.logprobs(token_rows)


def kept_tokens(padded: list[list[int]]) -> list[list[int]]:
    """Each row of `VerifyLaunch.tokens` (on the host) without its -1 padding."""
    return [[t for t in row if t >= 0] for row in padded]


@dataclass
class VerifyLaunch:
    """A verify step's sampling, queued on the device: nothing has waited for it yet.

    tokens [R, 1 + k] int64: each row's accepted drafts and one token of the target's, then -1 (k: the most drafts
    of a row). `logprobs(token_rows)` gives the kept tokens' logprobs once the rows are on the host."""

    tokens: torch.Tensor
    plain: list[int]  # the rows without drafts, sampled by the plain sampler ...
    plain_batch: SampledBatch | None  # ... their samples (copy to the host started)
    plain_rows: list[SamplingRow]
    spec: list[int]  # the rows with drafts ...
    spec_logprobs: PositionLogprobs | None  # ... their positions' logprobs (rows that asked)

    def logprobs(self, token_rows: list[list[int]]) -> list[list[Logprobs | None]]:
        out: list[list[Logprobs | None]] = [[None] * len(kept) for kept in token_rows]
        if self.plain_batch is not None:
            for i, lp in zip(self.plain, finish(self.plain_batch, self.plain_rows)[1]):
                out[i] = [lp]
        if self.spec_logprobs is not None:
            for i, lps in zip(self.spec, self.spec_logprobs.read([token_rows[i] for i in self.spec])):
                out[i] = lps
        return out


def launch_verify(logits: torch.Tensor, rows: list[VerifyRow], bitmask: GrammarBitmask | None,
                  generator: torch.Generator | None = None,
                  device_drafts: tuple[torch.Tensor, torch.Tensor] | None = None,
                  key_shift: torch.Tensor | None = None, histories: tuple | None = None) -> VerifyLaunch:
    """`verify`'s device work, queued without a wait: the step's tokens stay on the device until read.
    device_drafts: the rows' drafts proposed on the device ([R, k], and how many of each are real [R]: the draft
    positions past them are rejected), where the rows' own `drafts` are only DEVICE_DRAFT placeholders. key_shift:
    [R] positions each row's noise keys move back by, on the device (sampler.shift_keys). histories: the rows'
    token histories on the device (workers/token_history.py `read`: tokens [R, L], num_prompt [R], num_tokens [R],
    through the step before), which penalized positions read (`position_penalties`); None: their host lists."""
    starts = np.cumsum([0] + [1 + len(r.drafts) for r in rows])
    device, width = logits.device, 1 + max(len(r.drafts) for r in rows)
    plain = [i for i, r in enumerate(rows) if not r.drafts]
    # (a step of speculating rows only: their tokens are the step's, no row to gather or scatter)
    tokens = torch.full((len(rows), width), -1, dtype=torch.int64, device=device) if plain else None
    plain_batch, plain_rows = None, []
    if plain:
        x = logits[to_device(starts[plain], torch.long, device)].float()
        if bitmask is not None:
            apply_grammar_bitmask(x, bitmask, [rows[i].state.req_id for i in plain])
        plain_rows = [_sampling_row(rows[i], []) for i in plain]
        plain_index = to_device(plain, torch.long, device)
        plain_shift = None if key_shift is None else key_shift.index_select(0, plain_index)
        tensors = SamplingTensors.build(plain_rows, x.shape[1], device)
        penalties = None
        if histories is not None and tensors.penalty_rows:  # (no drafts: each its history through the step before)
            penalties = position_penalties([rows[i] for i in plain], tensors,
                                           tuple(t.index_select(0, plain_index) for t in histories),
                                           torch.zeros(len(plain), 0, dtype=torch.long, device=device))
        plain_batch = sample_async(x, plain_rows, generator, tensors=tensors, penalties=penalties, in_place=True,
                                   key_shift=plain_shift)
        tokens[plain_index, 0] = plain_batch.tokens
        plain_batch.start_copy()
    spec = [i for i, r in enumerate(rows) if r.drafts]
    spec_logprobs = None
    if spec:
        spec_logits = logits
        if plain:  # (a step of speculating rows only scores nothing else: no gather)
            index = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in spec])
            spec_logits = logits[to_device(index, torch.long, device)]
        raw = spec_logits.float()
        if bitmask is not None:  # each position's mask (the grammar after the drafts before it), as a plain row's
            spans = [(rows[i].state.req_id, starts[i + 1] - starts[i]) for i in spec]
            apply_grammar_bitmask(raw, bitmask, [r for r, n in spans for _ in range(n)],
                                  [j for _, n in spans for j in range(n)])
        spec_rows = [rows[i] for i in spec]
        spec_shift, spec_histories = key_shift, histories
        if plain:
            index = to_device(spec, torch.long, device)
            if device_drafts is not None:
                device_drafts = (device_drafts[0].index_select(0, index), device_drafts[1].index_select(0, index))
            spec_shift = None if key_shift is None else key_shift.index_select(0, index)
            spec_histories = None if histories is None else tuple(t.index_select(0, index) for t in histories)
        spec_tokens = _verify_drafts(raw, spec_rows, generator, device_drafts, spec_shift, spec_histories)
        if plain:
            tokens[index, :spec_tokens.shape[1]] = spec_tokens
        else:
            tokens = spec_tokens
        spec_logprobs = PositionLogprobs.launch(raw, spec_rows, spec_tokens)
    return VerifyLaunch(tokens, plain, plain_batch, plain_rows, spec, spec_logprobs)


def _sampling_row(row: VerifyRow, drafts_before: list[int]) -> SamplingRow:
    """The SamplingRow of the token after `drafts_before` (its history holds them; its key follows the position)."""
    state = row.state
    seed = None if row.seed_key is None else (row.seed_key + len(drafts_before)) % _MAX_KEY
    outputs = state.output_token_ids + drafts_before if drafts_before else state.output_token_ids
    return SamplingRow(state.params, state.prompt_token_ids, outputs, seed, state.num_pending, state.knobs,
                       state.num_unsure)


def _verify_drafts(raw: torch.Tensor, rows: list[VerifyRow], generator: torch.Generator | None,
                   device_drafts: tuple[torch.Tensor, torch.Tensor] | None = None,
                   key_shift: torch.Tensor | None = None, histories: tuple | None = None) -> torch.Tensor:
    """raw [P, V]: the rows' 1 + d positions each, raw logits. Greedy rows accept while the argmax equals the draft;
    the others are rejection-sampled (kernels/rejection_sampler.py). Returns [R, 1 + k] as `VerifyLaunch.tokens`,
    on the device. device_drafts, key_shift, histories: as `launch_verify`'s, for these rows."""
    # No knob on any row at any position (min_tokens met at the first one is met at the later ones): the argmax
    # of the raw logits, with no per-position rows and no knob tensors.
    if all(row.state.params.is_greedy and is_plain(_sampling_row(row, [])) for row in rows):
        return _greedy_accept(raw, rows, device_drafts)
    positions = [_sampling_row(row, row.drafts[:j]) for row in rows for j in range(len(row.drafts) + 1)]
    device, k = raw.device, max(len(row.drafts) for row in rows)
    all_draft_ids = _draft_ids(rows, k, device, device_drafts)
    tensors = SamplingTensors.build(positions, raw.shape[1], device)
    penalties = None
    if histories is not None and tensors.penalty_rows:
        penalties = position_penalties(rows, tensors, histories, all_draft_ids)
    starts = np.cumsum([0] + [len(row.drafts) + 1 for row in rows])
    shift = None  # each position's: its row's (its count of outputs moves back with it: apply_min_tokens)
    if key_shift is not None and any(p.min_tokens_unsure for p in positions):
        shift = key_shift.repeat_interleave(to_device(np.diff(starts), torch.long, device))
    x = apply_knobs(raw.clone(), positions, tensors, penalties, shift)
    out = torch.full((len(rows), k + 1), -1, dtype=torch.int64, device=device)
    for greedy in (True, False):
        sub = [r for r, row in enumerate(rows) if row.state.params.is_greedy == greedy]
        if not sub:
            continue
        sub_index = to_device(sub, torch.long, device)
        draft_ids = all_draft_ids.index_select(0, sub_index)
        num_drafts = to_device([len(rows[r].drafts) for r in sub], torch.long, device)
        if device_drafts is not None:  # (the rows' own drafts are placeholders: as many as the lookup found)
            num_drafts = torch.minimum(num_drafts, device_drafts[1].index_select(0, sub_index))
        # [len(sub), K + 1] -> flat position (past a row's own positions: its last, ignored)
        flat = to_device([[starts[r] + min(j, starts[r + 1] - starts[r] - 1) for j in range(k + 1)] for r in sub],
                         torch.long, device)
        if greedy:
            tokens, _ = greedy_accept_ref(x.argmax(dim=-1)[flat], draft_ids, num_drafts)
        else:
            index = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in sub])
            probs_flat = target_probs(x[to_device(index, torch.long, device)], [positions[i] for i in index])
            first = np.cumsum([0] + [len(rows[r].drafts) + 1 for r in sub])[:-1]
            local = to_device([[first[i] + min(j, len(rows[r].drafts)) for j in range(k + 1)]
                               for i, r in enumerate(sub)], torch.long, device)
            keys = to_device(_keys(rows, sub, k, generator), torch.long, device)  # (no wait for the step in flight)
            if key_shift is not None:
                keys = shift_keys(keys, key_shift.index_select(0, sub_index))
            tokens, _ = rejection_sample(probs_flat[local], draft_ids, num_drafts, keys,
                                         _draft_probs([rows[r] for r in sub], k, raw.shape[-1], device))
        out[sub_index] = tokens
    return out


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


def _greedy_accept(raw: torch.Tensor, rows: list[VerifyRow],
                   device_drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Greedy rows without knobs: each row's drafts while they equal the argmax, then the argmax ([R, 1 + k] as
    `VerifyLaunch.tokens`). One copy of the index tensors to the device."""
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
    if device_drafts is not None:  # (the rows' own drafts are placeholders)
        drafts_t, num_t = device_drafts[0][:, :k].reshape(-1), torch.minimum(num_t, device_drafts[1])
    tokens, _ = greedy_accept_ref(raw.argmax(dim=-1)[flat_t.view(num_rows, k + 1)], drafts_t.view(num_rows, k), num_t)
    return tokens


def _keys(rows: list[VerifyRow], sub: list[int], k: int, generator: torch.Generator | None) -> torch.Tensor:
    """[len(sub), K + 1] noise keys: a seeded row's follow its positions, the others are drawn."""
    keys = torch.randint(0, _MAX_KEY, (len(sub), k + 1), dtype=torch.int64, generator=generator)
    for i, r in enumerate(sub):
        if rows[r].seed_key is not None:
            keys[i] = torch.tensor([(rows[r].seed_key + j) % _MAX_KEY for j in range(k + 1)])
    return keys


def apply_knobs(x: torch.Tensor, rows: list[SamplingRow], tensors: SamplingTensors | None = None,
                penalties: PenaltyBatch | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
    """The knobs the plain sampler applies before its draw, in its order, in place on x [P, V]: allowed_token_ids,
    logit_bias, min_tokens, penalties (each position's history holds the drafts before it: `penalties` on the
    device, else the rows' host lists). shift: [P] on the device, as sample_async's key_shift."""
    apply_allowed_token_ids(x, rows)
    apply_logit_bias(x, rows)
    apply_min_tokens(x, rows, shift)
    apply_penalties(x, rows, tensors or SamplingTensors.build(rows, x.shape[1], x.device), penalties)
    return x


def _draft_ids(rows: list[VerifyRow], k: int, device, device_drafts: tuple | None) -> torch.Tensor:
    """[R, k] the rows' drafts on the device (0 past a row's own)."""
    if device_drafts is not None:
        return device_drafts[0][:, :k]
    return to_device([row.drafts + [0] * (k - len(row.drafts)) for row in rows], torch.long, device)


def position_penalties(rows: list[VerifyRow], tensors: SamplingTensors, histories: tuple,
                       draft_ids: torch.Tensor) -> PenaltyBatch:
    """The penalized positions' histories on the device: position j of a row holds the row's history (prompt and
    outputs through the step before, `histories` as `launch_verify`'s) and then its first j drafts. Each row's drafts
    are written after its history whatever j (past a position's length they are padding, which penalties skip)."""
    spans = [(r, j) for r, row in enumerate(rows) for j in range(len(row.drafts) + 1)]
    picked = [spans[p] for p in tensors.penalty_rows]
    index = to_device([r for r, _ in picked] + [j for _, j in picked], torch.long, draft_ids.device)
    row_index, before = index.split(len(picked))
    tokens, num_prompt, num_tokens = (t.index_select(0, row_index) for t in histories)
    drafts = draft_ids.index_select(0, row_index)
    k = drafts.shape[1]
    token_ids = torch.cat([tokens.long(), torch.zeros_like(drafts)], dim=1)
    token_ids.scatter_(1, num_tokens[:, None] + torch.arange(k, device=drafts.device)[None, :], drafts)
    return penalty_batch(tensors, token_ids, num_prompt, num_tokens + before)


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


@dataclass
class PositionLogprobs:
    """The logprobs of the tokens a verify step keeps, from the raw logits of their positions (as the plain
    sampler's: before any knob, the top max_k of the rows that asked, each row's first k of them), computed for
    every position of the rows that asked before it is known which are kept; copied to the host without a wait."""

    wanted: list[int]  # rows that asked
    k: list[int]  # their logprobs count
    width: int  # positions a row: 1 + the most drafts
    values: SampledBatch  # every position's token [W * width], its logprob, the top max_k values and ids

    @classmethod
    def launch(cls, raw: torch.Tensor, rows: list[VerifyRow], tokens: torch.Tensor) -> PositionLogprobs | None:
        wanted = [i for i, row in enumerate(rows) if row.state.params.logprobs is not None]
        if not wanted:
            return None
        width = tokens.shape[1]
        num_drafts = np.asarray([len(row.drafts) for row in rows], dtype=np.int64)
        starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        w = np.asarray(wanted, dtype=np.int64)
        # [W, width] -> flat position (past a row's own positions: its last, read and then ignored)
        flat = starts[w][:, None] + np.minimum(np.arange(width)[None, :], num_drafts[w][:, None])
        index = to_device(np.concatenate([flat.ravel(), w]), torch.long, raw.device)
        lp = torch.log_softmax(raw[index[:flat.size]], dim=-1)  # [W * width, V]
        kept = tokens[index[flat.size:]].reshape(-1).clamp(min=0)
        sampled = lp.gather(-1, kept[:, None]).squeeze(-1)
        max_k = max(rows[i].state.params.logprobs for i in wanted)
        values, ids = lp.topk(max_k, dim=-1) if max_k else (lp[:, :0], lp[:, :0].long())
        batch = SampledBatch(kept, [], sampled, values, ids).start_copy()
        return cls(wanted, [rows[i].state.params.logprobs for i in wanted], width, batch)

    def read(self, token_rows: list[list[int]]) -> list[list[Logprobs | None]]:
        """Each row's kept tokens' logprobs (None for rows that did not ask)."""
        _, sampled, values, ids = self.values.on_host()
        sampled, values, ids = sampled.tolist(), values.tolist(), ids.tolist()
        out: list[list[Logprobs | None]] = [[None] * len(kept) for kept in token_rows]
        for n, (i, k) in enumerate(zip(self.wanted, self.k)):
            for j in range(len(token_rows[i])):
                w = n * self.width + j
                out[i][j] = Logprobs(sampled[w], ids[w][:k], values[w][:k])
        return out


class VerifiedStep:
    """A launched speculative step; `result()` (as PendingStep's) waits for its tokens, appends them to the request
    states (the runner's `append_verified`) and returns the ModelRunnerOutput (None on ranks other than 0). The next
    step is launched after it: its inputs follow the tokens kept here.

    With `bitmask_req_ids` (deferred sampling, as PendingStep's) its forward is launched and its verification waits
    for `sample(bitmask)`: the driver's grammars need the tokens of the step before, and their masks at each
    position the drafts the workers proposed (`awaiting_drafts`)."""

    def __init__(self, runner, states: list, drafts: list[list[int]], prompt_logprobs, logits: torch.Tensor,
                 device_drafts: tuple[torch.Tensor, torch.Tensor] | None):
        self.runner = runner
        self.states, self.drafts = states, drafts
        self.prompt_logprobs = prompt_logprobs  # workers/prompt_logprobs.py PromptLogprobsBatch (rank 0), or None
        self.bitmask_req_ids: list[str] = []  # deferred sampling: the constrained rows whose bitmask it awaits
        self.logits: torch.Tensor | None = logits  # until sampled
        # the rows' device drafts and how many of each the lookup found (rank 0's; None: drafts from the driver),
        # until sampled
        self.device_drafts = device_drafts
        self._proposed: tuple[dict[str, int], SampledBatch] | None = None  # (deferred: `defer`)
        self.tokens: SampledBatch | None = None  # [R, 1 + k], every rank's, once sampled
        self.launched: VerifyLaunch | None = None  # rank 0's
        # device drafts: how many of each row's the lookup found (rank 0's; None: drafts from the driver)
        self.found: SampledBatch | None = None
        self._output: ModelRunnerOutput | None = None  # once read back

    def defer(self, constrained: list[str], proposed: tuple[dict[str, int], SampledBatch] | None) -> None:
        """Sampling waits for the bitmask of `constrained`. proposed: rank 0's device drafts on their way to the
        host (the row of each request that took some, and the copy the runner started behind the lookup)."""
        self.bitmask_req_ids, self._proposed = constrained, proposed

    def awaiting_drafts(self) -> dict[str, list[int]]:
        """Each row awaiting its bitmask and the drafts it verifies (none for a row without): its bitmask has a row
        for each position the grammar reaches through them (StructuredOutputManager.deferred_bitmask). Waits for
        the drafts' copy only, not for the forward."""
        drafts: dict[str, list[int]] = {req_id: [] for req_id in self.bitmask_req_ids}
        if self._proposed is not None:
            rows, copy = self._proposed
            host = copy.on_host()[0].tolist()
            rooms = {s.req_id: len(d) for s, d in zip(self.states, self.drafts)}
            for req_id in self.bitmask_req_ids:
                if req_id in rows:
                    drafts[req_id] = kept_tokens([host[rows[req_id]][:rooms[req_id]]])[0]
        return drafts

    def sample(self, bitmask: GrammarBitmask) -> None:
        """Deferred sampling: the verification with the driver's bitmask."""
        assert self.bitmask_req_ids and self.runner.awaiting is self, "this step does not await a bitmask"
        self.runner._sample_verify(self, bitmask)

    def sampled(self, tokens: torch.Tensor, launched: VerifyLaunch | None, found: torch.Tensor | None) -> None:
        self.tokens = SampledBatch(tokens, []).start_copy()
        self.launched, self.found = launched, None if found is None else SampledBatch(found, []).start_copy()
        self.bitmask_req_ids, self.logits, self.device_drafts, self._proposed = [], None, None, None

    def result(self) -> ModelRunnerOutput | None:
        if self._output is None:
            if self.tokens is None:
                raise RuntimeError(f"the step was never sampled: {self.bitmask_req_ids} await their bitmask")
            token_rows = kept_tokens(self.tokens.on_host()[0].tolist())
            logprobs = (self.launched.logprobs(token_rows) if self.launched is not None
                        else [[None] * len(t) for t in token_rows])
            output = ModelRunnerOutput(prompt_logprobs={} if self.prompt_logprobs is None
                                       else self.prompt_logprobs.outputs())
            found = self.found.on_host()[0].tolist() if self.found is not None else None
            for i, (state, d, new, lps) in enumerate(zip(self.states, self.drafts, token_rows, logprobs)):
                self.runner.append_verified(state, d, new)
                output.req_ids.append(state.req_id)
                output.sampled_token_ids.append(new[-1])
                output.logprobs.append(lps[-1])
                if d:
                    output.accepted_draft_ids[state.req_id] = new[:-1]
                    output.accepted_draft_logprobs[state.req_id] = lps[:-1]
                    if found is not None:
                        output.draft_counts[state.req_id] = min(found[i], len(d))
            self._output = output
        return self._output if self.runner.is_driver else None
