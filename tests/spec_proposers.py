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


class OracleLookup:
    """The workers' side of OracleProposer: a stand-in for the runner's device n-gram lookup (ModelRunner.lookup,
    kernels/ngram.py) with its signature, proposing each history's continuation in the non-speculative run
    (every `wrong_every`-th call's last draft changed), so that device drafts are accepted in part on the tiny model.
    It reads the histories back to the host: a test double for CPU runs, not a device kernel."""

    def __init__(self, references: list[tuple[list[int], list[int]]], k: int, wrong_every: int = 3):
        self.host = OracleProposer(references, k, wrong_every)

    def __call__(self, tokens, lengths, k: int, min_n: int, max_n: int):
        import torch

        drafts = torch.zeros(tokens.shape[0], k, dtype=torch.long)
        found = torch.zeros(tokens.shape[0], dtype=torch.long)
        for i, (row, n) in enumerate(zip(tokens.tolist(), lengths.tolist())):
            proposal = self.host.propose(np.asarray(row[:n], dtype=np.int64))[:k]
            drafts[i, :len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            found[i] = len(proposal)
        return drafts.to(tokens.device), found.to(tokens.device)
