"""Token ids of the requests that use penalties (or n-gram speculation), on the device: what repetition, frequency
and presence penalties read, kept where the sampler runs so that a step needs no host history and can run ahead of
its last token.

    tokens      [max_num_seqs, max_model_len + 1] int32   a slot (row) per request: prompt, then outputs (the
                                                      last column: where `append` writes its padding)
    num_tokens  [max_num_seqs]                        filled length, advanced on the device by `append`
    num_prompt  [max_num_seqs]

With n-gram speculation every request has a slot, on every rank: the workers' draft lookup reads it
(kernels/ngram.py). A verify step's kept tokens are written at its launch (`append`).

A request takes a slot when it joins the persistent batch (`add`: its prompt and, after a preemption, the outputs it
had, copied once) and frees it when it leaves; each step's sampled tokens are written on the device (`append`,
behind the sampling kernels in stream order), so an overlapped step's penalties already see the token that the
step before it sampled. Memory: 4 * max_num_seqs * max_model_len bytes (8 MiB at 256 x 8192), allocated with the
runner, so the memory profile counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from kernels.run_ahead import append_tokens
from workers.inputs import to_device


def uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.frequency_penalty) or bool(params.presence_penalty)


@dataclass
class PenaltyBatch:
    """The penalized rows of one step's logits and their token histories, all on the device.

    A row's history is `token_ids[i, :num_tokens[i]]`, its first `num_prompt[i]` entries the prompt; entries past
    num_tokens are padding of any valid token id."""

    rows: torch.Tensor  # [P] int64: rows of the logits
    token_ids: torch.Tensor  # [P, L] int64
    num_prompt: torch.Tensor  # [P] int64
    num_tokens: torch.Tensor  # [P] int64
    repetition: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    use_repetition: bool  # any row with repetition_penalty != 1 (decided on the host)
    use_frequency_presence: bool


class TokenHistory:
    def __init__(self, max_num_seqs: int, max_model_len: int, device: torch.device):
        self.device = device
        # (one column more: where `append` writes its padding, so that no real entry is written twice)
        self.tokens = torch.zeros(max_num_seqs, max_model_len + 1, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.num_prompt = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    @property
    def in_use(self) -> bool:
        """Whether any request holds a slot."""
        return len(self.free_slots) < self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1] - 1

    def add(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """A slot holding the request's tokens so far."""
        assert self.free_slots, "more requests with penalties than slots"
        assert prompt_token_ids, "a request has at least one prompt token"
        slot = self.free_slots.pop()
        n = len(prompt_token_ids) + len(output_token_ids)
        assert n <= self.max_len, f"{n} tokens do not fit a history of {self.max_len}"
        self.tokens[slot, :n] = to_device(prompt_token_ids + output_token_ids, torch.int32, self.device)
        self.num_tokens[slot] = n
        self.num_prompt[slot] = len(prompt_token_ids)
        return slot

    def remove(self, slot: int) -> None:
        """Frees the slot; a later `add` overwrites it (stream order: after any step still in flight)."""
        self.free_slots.append(slot)

    def append(self, slots: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Writes a step's tokens per slot (distinct slots [P], tokens [R, W]: each row's new tokens, then -1: a
        verify step's kept ones; rows [P]: the row of each slot, default 0..P-1), on the device, without reading
        back how many each row has (kernels/run_ahead.py: one launch on a GPU)."""
        append_tokens(self.tokens, self.num_tokens, slots, token_ids, rows)

    def read_tokens(self, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [P, width] int32, num_tokens [P]) of `slots`, width at least every filled length: what the
        n-gram lookup reads (kernels/ngram.py)."""
        return self.tokens[:, :min(width, self.max_len)].index_select(0, slots), self.num_tokens.index_select(0, slots)

    def read(self, slots: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids [P, L] int64, num_prompt [P], num_tokens [P]) of `slots`, read up to max_tokens columns
        (at least every filled length)."""
        tokens, num_tokens = self.read_tokens(slots, max_tokens)
        return tokens.long(), self.num_prompt.index_select(0, slots), num_tokens


def apply_history_penalties(x: torch.Tensor, batch: PenaltyBatch) -> torch.Tensor:
    """Penalties as vLLM defines them, in place on x [N, V], touching only the P x L history entries.

    Repetition (over prompt and output tokens): a seen token's logit is divided by the penalty when positive,
    multiplied when not. Then presence and frequency (over output tokens): x -= presence * (count > 0) +
    frequency * count. A token seen several times is written several times with one value computed from the same
    gathered logit, so duplicates agree; the frequency term is a scatter-add, one penalty per occurrence."""
    assert x.is_contiguous(), "penalties index the flat logits"
    vocab, width = x.shape[1], batch.token_ids.shape[1]
    flat = x.view(-1)
    pos = torch.arange(width, device=x.device)[None, :]
    is_token = pos < batch.num_tokens[:, None]
    ids = torch.where(is_token, batch.token_ids, batch.token_ids[:, :1])  # padding repeats the first entry
    offset = batch.rows[:, None] * vocab
    if batch.use_repetition:
        index = (offset + ids).view(-1)
        seen = flat.gather(0, index).view_as(ids)
        penalty = torch.where(batch.num_tokens > 0, batch.repetition, 1.0)[:, None]  # nothing seen: no penalty
        flat.scatter_(0, index, torch.where(seen > 0, seen / penalty, seen * penalty).view(-1))
    if batch.use_frequency_presence:
        is_output = is_token & (pos >= batch.num_prompt[:, None])
        first_output = ids.gather(1, batch.num_prompt.clamp(max=width - 1)[:, None])
        index = (offset + torch.where(is_output, ids, first_output)).view(-1)  # padding: the first output token
        has_output = (batch.num_tokens > batch.num_prompt).to(x.dtype)
        presence = (batch.presence * has_output)[:, None].expand_as(ids).reshape(-1)
        flat.scatter_(0, index, flat.gather(0, index) - presence)
        flat.index_add_(0, index, (-batch.frequency[:, None] * is_output).view(-1))
    return x
