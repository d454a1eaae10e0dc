"""Batched sampling on the device: one `sample` call picks the next token of every row of a logits batch.

Each row has its own `SamplingParams`; the per-row knobs become tensors so every step is one batched op:

    raw logits ──► logprobs (log_softmax of the raw logits, when asked)
        │
        ├─ logit_bias ─ min_tokens (mask stop tokens) ─ repetition / frequency / presence penalties
        ├─ greedy rows: argmax
        └─ random rows: temperature ─ top-k ─ top-p ─ min-p ─ softmax ─ exponential race (argmax probs / Exp(1))

The exponential race draws its noise from the row's own `generator` when it has one, so a seeded request samples
the same tokens whatever else is in the batch; unseeded rows share `default_generator` (torch's global one if None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams
from workers.inputs import to_device


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # on the logits' device; set for seeded requests
    num_pending: int = 0  # outputs sampled but not yet in output_token_ids (overlapped steps)

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_pending


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


def sample_async(logits: torch.Tensor, rows: list[SamplingRow],
                 default_generator: torch.Generator | None = None) -> SampledBatch:
    """Samples on the device without waiting for the result."""
    assert logits.shape[0] == len(rows), f"{logits.shape[0]} logits rows for {len(rows)} sampling rows"
    if not rows:
        return SampledBatch(torch.empty(0, dtype=torch.long, device=logits.device), [])
    raw = logits.float()
    if all(row.params.is_greedy and _is_plain(row) for row in rows):
        tokens = raw.argmax(dim=-1)  # the common fast path: nothing to process, nothing to copy
        return logprobs_on_device(raw, tokens, rows)
    x = apply_logit_bias(raw.clone(), rows)  # [N, V]
    x = apply_min_tokens(x, rows)
    x = apply_penalties(x, rows)
    tokens = x.argmax(dim=-1)  # [N]: the greedy rows' answer
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        index = to_device(random_rows, torch.long, x.device)
        tokens[index] = _sample_random(x[index], [rows[i] for i in random_rows], default_generator)
    return logprobs_on_device(raw, tokens, rows)


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


def _is_plain(row: SamplingRow) -> bool:
    """No logit processing applies to this row at this step."""
    params = row.params
    return (not params.logit_bias and params.repetition_penalty == 1.0 and not params.frequency_penalty
            and not params.presence_penalty and row.num_outputs >= params.min_tokens)


def _sample_random(x: torch.Tensor, rows: list[SamplingRow], default_generator) -> torch.Tensor:
    # x: [R, V] processed logits of the random rows -> [R] token ids
    # Which filters apply is decided here from the params, on the host: a device-side test would wait for the
    # device, and so for the step launched before this one (no overlap).
    temperature = _row_values(rows, lambda p: p.temperature, x)
    x = x / temperature[:, None]
    use_k = any(row.params.top_k > 0 for row in rows)
    use_p = any(row.params.top_p < 1.0 for row in rows)
    if use_k or use_p:
        x = apply_top_k_top_p(x, _row_values(rows, lambda p: p.top_k, x, torch.long),
                              _row_values(rows, lambda p: p.top_p, x), use_k, use_p)
    if any(row.params.min_p > 0 for row in rows):
        x = apply_min_p(x, _row_values(rows, lambda p: p.min_p, x), check=False)
    probs = x.softmax(dim=-1)
    return exponential_race(probs, [row.generator for row in rows], default_generator)


def _row_values(rows: list[SamplingRow], get, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return to_device([get(row.params) for row in rows], dtype, like.device)


def _scatter_index(rows: list[SamplingRow], get_ids, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs over all rows, as two int64 tensors."""
    row_idx, token_idx = [], []
    for i, row in enumerate(rows):
        ids = get_ids(row)
        row_idx.extend([i] * len(ids))
        token_idx.extend(ids)
    return to_device(row_idx, torch.long, device), to_device(token_idx, torch.long, device)


def apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """x[i, t] += params.logit_bias[t]."""
    if not any(row.params.logit_bias for row in rows):
        return x
    row_idx, token_idx = _scatter_index(rows, lambda r: list((r.params.logit_bias or {}).keys()), x.device)
    bias = [b for row in rows for b in (row.params.logit_bias or {}).values()]
    x.index_put_((row_idx, token_idx), to_device(bias, x.dtype, x.device), accumulate=True)
    return x


def apply_min_tokens(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Stop tokens get -inf while a row has produced fewer than min_tokens tokens."""
    blocked = lambda r: (list(r.params.all_stop_token_ids)  # noqa: E731
                         if r.num_outputs < r.params.min_tokens else [])
    if not any(blocked(row) for row in rows):
        return x
    row_idx, token_idx = _scatter_index(rows, blocked, x.device)
    x[row_idx, token_idx] = float("-inf")
    return x


def _token_counts(rows: list[SamplingRow], get_ids, x: torch.Tensor) -> torch.Tensor:
    """[N, V] occurrence counts of each row's token ids."""
    row_idx, token_idx = _scatter_index(rows, get_ids, x.device)
    counts = torch.zeros_like(x)
    counts.index_put_((row_idx, token_idx), torch.ones_like(row_idx, dtype=x.dtype), accumulate=True)
    return counts


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty (Hugging Face: over prompt and output tokens, positive logits divided by it, negative
    multiplied), then frequency and presence penalties (OpenAI: over output tokens,
    x -= frequency * count + presence * (count > 0))."""
    if any(row.params.repetition_penalty != 1.0 for row in rows):
        seen = _token_counts(rows, lambda r: r.prompt_token_ids + r.output_token_ids, x) > 0
        penalty = _row_values(rows, lambda p: p.repetition_penalty, x)[:, None].expand_as(x)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if any(row.params.frequency_penalty or row.params.presence_penalty for row in rows):
        counts = _token_counts(rows, lambda r: r.output_token_ids, x)
        frequency = _row_values(rows, lambda p: p.frequency_penalty, x)[:, None]
        presence = _row_values(rows, lambda p: p.presence_penalty, x)[:, None]
        x = x - frequency * counts - presence * (counts > 0).to(x.dtype)
    return x


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool | None = None,
                      use_p: bool | None = None) -> torch.Tensor:
    """Keeps the k largest logits (k = 0: all), then the smallest set of those whose probability reaches top_p.

    x: [R, V]; top_k: int64 [R]; top_p: [R]. Dropped logits become -inf. use_k / use_p: whether any row uses
    them, when the caller knows (else read from the tensors, which waits for the device)."""
    vocab = x.shape[-1]
    use_k = bool((top_k > 0).any()) if use_k is None else use_k
    use_p = bool((top_p < 1.0).any()) if use_p is None else use_p
    if not (use_k or use_p):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    if use_p:
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop[:, 0] = False  # the most likely token always stays
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the top token's: p_t / p_max = exp(x_t - x_max)."""
    if check and not bool((min_p > 0).any()):
        return x
    threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # -inf where min_p == 0
    return x.masked_fill(x < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None],
                     default_generator: torch.Generator | None = None) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exponential(1) i.i.d. picks token t with probability probs[t].

    probs: [R, V] -> [R]. Rows with a generator draw their own noise; the others share one batched draw."""
    noise = torch.empty_like(probs).exponential_(generator=default_generator)
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)


def logprobs_on_device(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> SampledBatch:
    """Logprobs from the raw logits: the sampled token's, and the top `params.logprobs` alternatives."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return SampledBatch(tokens, [])
    index = to_device(wanted, torch.long, raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)  # [W, V]
    sampled = logprobs.gather(-1, tokens[index][:, None]).squeeze(-1)
    max_k = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (logprobs[:, :0], logprobs[:, :0].long())
    return SampledBatch(tokens, wanted, sampled, top_values, top_ids)


def compute_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[Logprobs | None]:
    return finish(logprobs_on_device(raw, tokens, rows), rows)[1]
