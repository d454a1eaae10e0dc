"""Speculative decoding on the driver: the configuration (vLLM's `speculative_config` dict) and the proposers.

    step N:  propose()  ──► req.spec_token_ids = d drafts (d <= k) for each running decode request
             schedule() ──► the request runs 1 + d tokens (its last token and the drafts), KV slots reserved for all
             runner     ──► scores the 1 + d positions, keeps the drafts the target agrees with (workers/spec_verify.py)
                            and one token of its own: 1 to d + 1 tokens a step
             update_from_output() ──► appends them; the rejected drafts' KV slots are given back (BlockManager.shrink)

A proposer sees only token ids on the driver. The n-gram proposer (prompt lookup) finds the latest earlier
occurrence of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the up
to k tokens that followed it. Its draft distribution is one-hot, which is what the verification assumes
(kernels/rejection_sampler.py). A draft model or an EAGLE head would be a `Proposer` too, run on the workers, that
also returns its draft probabilities; neither is built.

Requests that are never speculated: those with a grammar (a draft would need a mask per position), those still in
prefill, and while overlapped scheduling is on the engine turns it off (a step's drafts need the previous step's
accepted tokens on the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.request import Request

class Proposer(Protocol):
    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (the sequence's known tokens, int64), possibly none."""
        ...


@dataclass
class NgramProposer:
    """Prompt lookup, vectorized over the sequence: per n, one comparison of every window with the last n tokens."""

    num_speculative_tokens: int
    min_n: int
    max_n: int

    def propose(self, token_ids: np.ndarray) -> list[int]:
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows[i] = token_ids[i:i + n] for every start i that leaves a token after it (i + n <= length - 1)
            windows = np.lib.stride_tricks.sliding_window_view(token_ids[:length - 1], n)
            hits = np.flatnonzero((windows == token_ids[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence
                return token_ids[start:start + self.num_speculative_tokens].tolist()
        return []


@dataclass
class SpecDecodeStats:
    """Counters with vLLM's meaning: drafts scored, drafts accepted, and accepted drafts by position (index j: the
    j-th draft of a step accepted)."""

    num_drafts: int = 0  # steps of a request that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecDecoder:
    """Proposes drafts for the running requests before each schedule() (the scheduler trims them to its budget)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer: Proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                                config.prompt_lookup_max)

    def propose(self, running: list[Request]) -> None:
        for req in running:
            req.spec_token_ids = self.propose_for(req) if can_speculate(req) else []

    def propose_for(self, req: Request) -> list[int]:
        room = req.max_tokens - req.num_output_tokens - 1  # the step samples one token of its own too
        if room <= 0:
            return []
        return self.proposer.propose(np.asarray(req.all_token_ids, dtype=np.int64))[:room]


def can_speculate(req: Request) -> bool:
    """A decode step (its last token is the only one not in the KV cache) of a request without a grammar."""
    return (req.grammar is None and req.num_pending_tokens == 0
            and req.num_computed_tokens == req.num_tokens - 1)
