"""A proposer for tests of speculative decoding: drafts known to be (mostly) right, so acceptance is high on
models whose output n-gram lookup cannot predict."""

from __future__ import annotations

import numpy as np


class OracleProposer:
    """Proposes the non-speculative run's own continuation of a sequence (every `wrong_every`-th proposal's last
    draft changed), or nothing for a sequence it does not know."""

    def __init__(self, references: list[tuple[list[int], list[int]]], k: int, wrong_every: int = 3):
        self.references, self.k, self.wrong_every, self.calls = references, k, wrong_every, 0

    def propose(self, token_ids: np.ndarray) -> list[int]:
        tokens = token_ids.tolist()
        for prompt, output in self.references:
            m = len(tokens) - len(prompt)
            if m >= 0 and tokens[:len(prompt)] == prompt and tokens[len(prompt):] == output[:m]:
                drafts = output[m:m + self.k]
                self.calls += 1
                if drafts and self.calls % self.wrong_every == 0:
                    drafts[-1] = (drafts[-1] + 1) % 500
                return drafts
        return []
