"""The workers' n-gram lookup on the device (workers/ngram_drafts.py) against the driver's (engine/spec_decode.py
NgramProposer): the same drafts for the same tokens, so a step launched ahead proposes what a pipelined one would."""

import numpy as np
import pytest
import torch

from engine.spec_decode import NgramProposer
from workers.ngram_drafts import ngram_drafts


@pytest.mark.parametrize("seed", range(4))
def test_device_lookup_gives_the_host_lookups_drafts(seed):
    """Random histories over small vocabularies (many matches of every length), padded rows of different lengths,
    every k / min_n / max_n up to 5: row by row, the found drafts are the host proposer's."""
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(250):
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        rows, width = int(rng.integers(1, 6)), int(rng.integers(1, 48))
        tokens = rng.integers(0, int(rng.integers(2, 7)), size=(rows, width))
        lengths = rng.integers(1, width + 1, size=rows)
        drafts, found = ngram_drafts(torch.tensor(tokens, dtype=torch.int32), torch.tensor(lengths), k, min_n, max_n)
        assert drafts.shape == (rows, k) and found.shape == (rows,)
        proposer = NgramProposer(k, min_n, max_n)
        for r in range(rows):
            expected = proposer.propose(tokens[r, :lengths[r]].astype(np.int64))
            assert drafts[r, :found[r]].tolist() == expected, (tokens[r, :lengths[r]], k, min_n, max_n)
            checked += bool(expected)
    assert checked > 100  # most rows found a match: the drafts themselves were compared, not only empty ones


def test_device_lookup_takes_the_latest_of_the_longest_matches():
    tokens = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 7, 2, 3, 8, 1, 2, 3]], dtype=torch.int32)
    drafts, found = ngram_drafts(tokens, torch.tensor([14]), 3, 1, 3)
    assert found.tolist() == [3] and drafts.tolist() == [[7, 2, 3]]  # [1 2 3] last seen before 7 (not [2 3] -> 8)
    _, none = ngram_drafts(tokens, torch.tensor([14]), 3, 4, 4)  # no 4-token match
    assert none.tolist() == [0]
