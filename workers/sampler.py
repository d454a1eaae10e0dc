"""Batched sampling on the device: one `sample` call picks the next token of every row of a logits batch.

Each row has its own `SamplingParams`; the per-row knobs become tensors (`SamplingTensors`, which the model runner
builds once and reuses while its batch does not change), so every step is a few batched ops:

    raw logits ──► logprobs (log_softmax of the raw logits, when asked)
        │
        ├─ allowed_token_ids (-inf elsewhere) ─ logit_bias ─ min_tokens (mask stop tokens) ─ repetition /
        │  frequency / presence penalties, from the token histories (workers/token_history.py: on the device in
        │  the runner, so steps can overlap)
        └─ kernels/sampling.py, every row at once: temperature, top-k (a threshold from torch.topk; a top-k row
           reads only its largest logits), min-p, top-p (by rejection: no sort of the vocabulary), a Gumbel-max
           draw; greedy rows take the argmax

A row's noise comes from a 64-bit key. A seeded request's key depends only on its seed and the position it samples
(`SamplingRow.seed`), so it gets the same tokens whatever else is in the batch; the other rows draw a key each step
from `default_generator` (torch's global one if None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams
from kernels.sampling import sample_tokens
from workers.inputs import to_device
from workers.token_history import PenaltyBatch, apply_history_penalties, uses_penalties

_MAX_KEY = 1 << 62
_TIE_MARGIN = 32  # logits past the largest top-k that a top-k row's subset holds, for ties at its k-th logit


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None = None  # this step's noise key (seeded requests); None: a fresh one
    num_pending: int = 0  # outputs sampled but not yet in output_token_ids (overlapped steps)
    knobs: RowKnobs | None = None  # row_knobs(params), when the caller keeps them (the runner: once per request)
    # of num_pending, the drafts of a verify step not yet read back, counted as accepted: as many as it rejected
    # are taken back on the device (the `shift` of apply_min_tokens)
    num_unsure: int = 0

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def min_outputs(self) -> int:
        """Its outputs if the verify step in flight rejects every draft (num_outputs if none is in flight)."""
        return self.num_outputs - self.num_unsure

    @property
    def min_tokens_unsure(self) -> bool:
        return min_tokens_unsure(self.params.min_tokens, self.num_outputs, self.num_unsure)


def min_tokens_unsure(min_tokens: int, num_outputs: int, num_unsure: int) -> bool:
    """Whether a row's min_tokens mask waits on the device's count of its outputs: num_outputs counts the drafts of
    the verify step in flight as accepted, and taking back its num_unsure drafts would leave it short."""
    return num_unsure > 0 and num_outputs - num_unsure < min_tokens


class RowKnobs(NamedTuple):
    """One row's sampling knobs, as the kernels take them (a tuple: a batch's rows are packed column by column
    into one [8, N] tensor, in this order; SamplingTensors names the columns back)."""

    inv_temperature: float
    noise_scale: float  # 0 (greedy) or 1
    top_p: float
    log_min_p: float  # -inf: no min-p
    top_k: int  # 0: off
    repetition: float
    frequency: float
    presence: float


_PENALTIES = slice(RowKnobs._fields.index("repetition"), None)  # the packed rows of the three penalties


def row_knobs(params: SamplingParams) -> RowKnobs:
    """A row's knobs; greedy rows have no noise and no filters."""
    penalties = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    if params.is_greedy:
        return RowKnobs(1.0, 0.0, 1.0, float("-inf"), 0, *penalties)
    log_min_p = math.log(params.min_p) if params.min_p > 0 else float("-inf")
    return RowKnobs(1.0 / params.temperature, 1.0, params.top_p, log_min_p, params.top_k, *penalties)


@dataclass
class SamplingTensors:
    """The rows' knobs on the device, and what the host knows of them (to pick the ops without asking it)."""

    inv_temperature: torch.Tensor  # [N] float32
    noise_scale: torch.Tensor  # [N] 0 (greedy) or 1
    top_p: torch.Tensor  # [N]
    log_min_p: torch.Tensor  # [N] -inf: no min-p
    top_k: torch.Tensor  # [N] float32 holding k (0: off)
    penalties: torch.Tensor  # [3, P] repetition, frequency, presence of the penalty rows
    penalty_rows: list[int]  # rows with a penalty
    penalty_index: torch.Tensor  # [P] int64, those rows on the device
    max_top_k: int
    is_random: bool  # any row that samples
    use_repetition: bool  # any row with repetition_penalty != 1
    use_frequency_presence: bool  # any row with a frequency or presence penalty

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> SamplingTensors:
        """Two host-to-device copies and a pass over the rows' knob tuples, whatever the batch size."""
        knobs = [row.knobs or row_knobs(row.params) for row in rows]
        columns = RowKnobs(*zip(*knobs))  # each field: that knob of every row
        # Rows of [8, N] start 16-byte aligned whatever N: Triton compiles a sampling kernel per alignment of its
        # pointers (0.5 s each on an H200, while every request waits).
        width = -(-len(rows) // 4) * 4
        packed = to_device([c + (0.0,) * (width - len(c)) for c in columns], torch.float32, device)[:, :len(rows)]
        on_device = RowKnobs(*packed)  # views of packed's rows
        on_device.top_k.clamp_(max=vocab_size)
        penalty_rows = [i for i, (r, f, p) in enumerate(zip(columns.repetition, columns.frequency, columns.presence))
                        if r != 1.0 or f or p]
        penalty_index = to_device(penalty_rows, torch.long, device)
        return cls(on_device.inv_temperature, on_device.noise_scale, on_device.top_p, on_device.log_min_p,
                   on_device.top_k, penalties=packed[_PENALTIES].index_select(1, penalty_index),
                   penalty_rows=penalty_rows, penalty_index=penalty_index,
                   max_top_k=min(max(columns.top_k), vocab_size), is_random=max(columns.noise_scale) > 0,
                   use_repetition=any(r != 1.0 for r in columns.repetition),
                   use_frequency_presence=any(f or p for f, p in zip(columns.frequency, columns.presence)))


@dataclass
class SampledBatch:
    """A step's samples on the device. `start_copy` queues their copy to pinned host memory right behind the
    sampling kernels; `finish` waits for that copy only (the step's one sync). A plain `.tolist()` would wait for
    the whole stream, the step launched after this one included, and undo the overlap."""

    tokens: torch.Tensor  # [N]
    logprob_rows: list[int]  # rows that asked for logprobs
    sampled_logprobs: torch.Tensor | None = None  # [W]
    top_logprobs: torch.Tensor | None = None  # [W, k]
    top_ids: torch.Tensor | None = None  # [W, k]
    host: tuple | None = None  # pinned copies of the four tensors above, once start_copy ran
    copied: torch.cuda.Event | None = None

    def start_copy(self) -> SampledBatch:
        if self.tokens.device.type == "cuda":
            self.host = tuple(None if t is None else _pinned_copy(t) for t in
                              (self.tokens, self.sampled_logprobs, self.top_logprobs, self.top_ids))
            self.copied = torch.cuda.Event()
            self.copied.record()
        return self

    def on_host(self) -> tuple:
        """(tokens, sampled_logprobs, top_logprobs, top_ids) on the host, waiting for their copy if needed."""
        if self.host is None:
            return self.tokens, self.sampled_logprobs, self.top_logprobs, self.top_ids
        self.copied.synchronize()
        return self.host


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator | None = None,
           ) -> tuple[list[int], list[Logprobs | None]]:
    """logits: [N, V], one row per SamplingRow. Returns the N sampled token ids and their logprobs."""
    return finish(sample_async(logits, rows, default_generator), rows)


def sample_async(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator | None = None,
                 tensors: SamplingTensors | None = None, penalties: PenaltyBatch | None = None,
                 in_place: bool = False, key_shift: torch.Tensor | None = None) -> SampledBatch:
    """Samples on the device without waiting for the result.

    tensors: the rows' knobs (built here when None). penalties: the penalized rows' token histories on the device
    (None: built from the rows' host token lists). in_place: the logits are the caller's to overwrite. key_shift:
    [N] on the device, how far back each row's position moved (the drafts the verify step in flight rejected): taken
    off its noise key (`noise_keys`) and off its count of outputs (`apply_min_tokens`)."""
    assert logits.shape[0] == len(rows), f"{logits.shape[0]} logits rows for {len(rows)} sampling rows"
    if not rows:
        return SampledBatch(torch.empty(0, dtype=torch.long, device=logits.device), [])
    raw = logits.float()
    if all(row.params.is_greedy and is_plain(row) for row in rows):
        return _with_logprobs(raw.argmax(dim=-1), _top_logprobs(raw, rows))  # nothing to process
    logprobs = _top_logprobs(raw, rows)  # from the raw logits, before anything below changes them
    x = raw if in_place or raw is not logits else raw.clone()
    x = x.contiguous()  # penalties index the flat logits (a vocabulary padded for tp arrives as a slice)
    tensors = tensors or SamplingTensors.build(rows, x.shape[1], x.device)
    apply_allowed_token_ids(x, rows)
    apply_logit_bias(x, rows)
    apply_min_tokens(x, rows, key_shift)
    apply_penalties(x, rows, tensors, penalties)
    kth, subset = _candidates(x, tensors)
    tokens = sample_tokens(x, tensors.inv_temperature, kth, tensors.top_p, tensors.log_min_p, tensors.noise_scale,
                           _noise_keys(rows, tensors, default_generator, x.device, key_shift), subset)
    return _with_logprobs(tokens, logprobs)


def finish(batch: SampledBatch, rows: list[SamplingRow]) -> tuple[list[int], list[Logprobs | None]]:
    """The samples on the host: token ids and, for rows that asked, their logprobs."""
    tokens, sampled, top_values, top_ids = batch.on_host()
    tokens = tokens.tolist()
    out: list[Logprobs | None] = [None] * len(rows)
    if not batch.logprob_rows:
        return tokens, out
    sampled, top_values, top_ids = sampled.tolist(), top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(batch.logprob_rows):
        k = rows[i].params.logprobs
        out[i] = Logprobs(sampled_logprob=sampled[j], top_token_ids=top_ids[j][:k], top_logprobs=top_values[j][:k])
    return tokens, out


def is_plain(row: SamplingRow) -> bool:
    """No logit processing applies to this row at this step."""
    params = row.params
    return (not params.logit_bias and not params.allowed_token_ids and not uses_penalties(params)
            and row.min_outputs >= params.min_tokens)


def _candidates(x: torch.Tensor, tensors: SamplingTensors) -> tuple[torch.Tensor, tuple | None]:
    """([N] top-k threshold (-inf: none), the largest logits and their ids, or None without top-k rows).

    The threshold is the row's k-th largest logit (torch.topk: no sort of the vocabulary). The kernel reads a
    top-k row's subset only (max k plus a margin for ties at the k-th logit), unless its ties run past it."""
    if tensors.max_top_k == 0:
        return torch.full_like(tensors.top_k, float("-inf")), None
    values, ids = x.topk(min(x.shape[1], tensors.max_top_k + _TIE_MARGIN), dim=-1)  # [N, S], sorted
    k = tensors.top_k.long()
    kth = torch.where(k > 0, values.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1), float("-inf"))
    return kth, (values, ids)


def _noise_keys(rows: list[SamplingRow], tensors: SamplingTensors, generator, device,
                key_shift: torch.Tensor | None = None) -> torch.Tensor:
    """[N] int64: each row's noise key for this step (greedy rows ignore theirs)."""
    if not tensors.is_random:
        return torch.zeros(len(rows), dtype=torch.int64, device=device)
    keys = torch.randint(0, _MAX_KEY, (len(rows),), dtype=torch.int64, device=device, generator=generator)
    seeded = [i for i, row in enumerate(rows) if row.seed is not None]
    if seeded:
        keys[to_device(seeded, torch.long, device)] = to_device([rows[i].seed % _MAX_KEY for i in seeded],
                                                                torch.long, device)
    return keys if key_shift is None else shift_keys(keys, key_shift)


def shift_keys(keys: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Noise keys moved back by `shift` positions ([N], broadcast over keys' later dims), on the device: a seeded
    row's key follows its position (workers/model_runner.py seed_key), and a step launched before the verify step
    in flight is read back keys its rows by positions that step's rejected drafts move back. A drawn key moved stays
    a drawn key."""
    return torch.remainder(keys - shift.view(-1, *([1] * (keys.dim() - 1))), _MAX_KEY)


def _scatter_index(rows: list[SamplingRow], get_ids, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs over all rows, as two int64 tensors."""
    row_idx, token_idx = [], []
    for i, row in enumerate(rows):
        ids = get_ids(row)
        row_idx.extend([i] * len(ids))
        token_idx.extend(ids)
    return to_device(row_idx, torch.long, device), to_device(token_idx, torch.long, device)


def apply_allowed_token_ids(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """x[i, t] = -inf for every t not in a row's params.allowed_token_ids (rows without them are left alone)."""
    restricted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if not restricted:
        return x
    row_idx, token_idx = _scatter_index(rows, lambda r: r.params.allowed_token_ids or [], x.device)
    allowed = torch.zeros_like(x, dtype=torch.bool)  # [N, V]
    allowed[row_idx, token_idx] = True
    unrestricted = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    unrestricted[to_device(restricted, torch.long, x.device)] = False
    x.masked_fill_(~(allowed | unrestricted[:, None]), float("-inf"))
    return x


def apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """x[i, t] += params.logit_bias[t]."""
    if not any(row.params.logit_bias for row in rows):
        return x
    row_idx, token_idx = _scatter_index(rows, lambda r: list((r.params.logit_bias or {}).keys()), x.device)
    bias = [b for row in rows for b in (row.params.logit_bias or {}).values()]
    x.index_put_((row_idx, token_idx), to_device(bias, x.dtype, x.device), accumulate=True)
    return x


def apply_min_tokens(x: torch.Tensor, rows: list[SamplingRow], shift: torch.Tensor | None = None) -> torch.Tensor:
    """Stop tokens get -inf while a row has produced fewer than min_tokens tokens, unless nothing else is left to
    sample (a grammar that allows only its end, a logit_bias of -inf on every other token): then min_tokens yields
    and the row may stop early, rather than sample from an empty distribution.

    A row sampled while a verify step of it is in flight counts that step's drafts as accepted (`num_unsure` of
    them); shift [N] on the device (None: 0) is how many that step rejected, so its count is known there only: the
    rows that may be short of min_tokens are masked where num_outputs - shift < min_tokens, on the device."""
    blocked = lambda r: (list(r.params.all_stop_token_ids)  # noqa: E731
                         if r.min_outputs < r.params.min_tokens else [])
    under = [i for i, row in enumerate(rows) if blocked(row)]
    if not under:
        return x
    row_idx, token_idx = _scatter_index(rows, blocked, x.device)
    kept = x[row_idx, token_idx]
    x[row_idx, token_idx] = float("-inf")
    under_idx = to_device(under, torch.long, x.device)
    masked = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    masked[under_idx] = (x[under_idx] != float("-inf")).any(dim=-1)  # another token is left to sample
    if any(rows[i].min_tokens_unsure for i in under):
        short = to_device([row.params.min_tokens - row.num_outputs for row in rows], torch.long, x.device)
        masked &= short + (0 if shift is None else shift) > 0
    x[row_idx, token_idx] = torch.where(masked[row_idx], float("-inf"), kept)
    return x


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow], tensors: SamplingTensors | None = None,
                    penalties: PenaltyBatch | None = None) -> torch.Tensor:
    """Repetition penalty (over prompt and output tokens, positive logits divided by it, negative multiplied),
    then frequency and presence penalties (over output tokens, x -= frequency * count + presence * (count > 0)),
    in place. penalties: the histories on the device; None: from the rows' host token lists."""
    tensors = tensors or SamplingTensors.build(rows, x.shape[1], x.device)
    if not tensors.penalty_rows:
        return x
    if penalties is None:
        penalties = host_penalty_batch(rows, tensors, x.device)
    return apply_history_penalties(x, penalties)


def host_penalty_batch(rows: list[SamplingRow], tensors: SamplingTensors, device) -> PenaltyBatch:
    """The penalized rows' histories from their host token lists (one copy)."""
    histories = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in tensors.penalty_rows]
    width = max(1, *map(len, histories))
    padded = [h + [h[0] if h else 0] * (width - len(h)) for h in histories]
    counts = to_device([[len(rows[i].prompt_token_ids) for i in tensors.penalty_rows], list(map(len, histories))],
                       torch.long, device)
    return penalty_batch(tensors, to_device(padded, torch.long, device), counts[0], counts[1])


def penalty_batch(tensors: SamplingTensors, token_ids: torch.Tensor, num_prompt: torch.Tensor,
                  num_tokens: torch.Tensor) -> PenaltyBatch:
    """The penalized rows of `tensors` with their histories (token_ids [P, L], num_prompt [P], num_tokens [P])."""
    repetition, frequency, presence = tensors.penalties
    return PenaltyBatch(tensors.penalty_index, token_ids, num_prompt, num_tokens, repetition, frequency, presence,
                        tensors.use_repetition, tensors.use_frequency_presence)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-k / top-p masks by definition, with a full sort (the specification the sampling kernel is tested
    against; sampling itself never sorts): keeps the k largest logits (k = 0: all), then the smallest set of those
    whose probability reaches top_p. x: [R, V]; top_k: int64 [R]; top_p: [R]. Dropped logits become -inf."""
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False  # the most likely token always stays
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The min-p mask by definition: drops tokens whose probability is below min_p times the top token's,
    p_t / p_max = exp(x_t - x_max)."""
    threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # -inf where min_p == 0
    return x.masked_fill(x < threshold, float("-inf"))


def _top_logprobs(raw: torch.Tensor, rows: list[SamplingRow]) -> tuple | None:
    """(rows, index, log_softmax [W, V], top values, top ids) for the rows that asked for logprobs."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return None
    index = to_device(wanted, torch.long, raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)  # [W, V]
    max_k = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (logprobs[:, :0], logprobs[:, :0].long())
    return wanted, index, logprobs, top_values, top_ids


def _with_logprobs(tokens: torch.Tensor, logprobs: tuple | None) -> SampledBatch:
    """The step's SampledBatch: the sampled token's logprob and the top alternatives, from the raw logits."""
    if logprobs is None:
        return SampledBatch(tokens, [])
    wanted, index, values, top_values, top_ids = logprobs
    sampled = values.gather(-1, tokens[index][:, None]).squeeze(-1)
    return SampledBatch(tokens, wanted, sampled, top_values, top_ids)


def warm_up_sampler(vocab_size: int, device: torch.device) -> None:
    """Compiles the sampling kernel's two variants now (without and with a top-k subset), not in the first steps
    that use them: each cost an H200's step loop 0.5-0.7 s while every request waited (the first run of top-k /
    top-p / repetition-penalty requests after a start measured 0.88 of greedy's throughput, the next 0.99)."""
    logits = torch.randn(2, vocab_size, device=device)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [1], []),
            SamplingRow(SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1), [1], [])]
    for batch in (rows[:1], rows):
        finish(sample_async(logits[:len(batch)].clone(), batch), batch)
