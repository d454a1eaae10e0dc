"""The workers' n-gram lookup on the device (kernels/ngram.py): the torch reference against the driver's
(engine/spec_decode.py NgramProposer), the same drafts for the same tokens, so a step launched ahead proposes what a
pipelined one would; and the Triton kernel against the reference, exactly (under the interpreter on CPU)."""

import numpy as np
import pytest
import torch

from engine.spec_decode import NgramProposer
from kernels.ngram import ngram_lookup_ref, ngram_lookup_triton


def _cases(seed: int, count: int):
    """Random histories over small vocabularies (many matches of every length), padded rows of different lengths,
    every k / min_n / max_n up to 5."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        rows, width = int(rng.integers(1, 6)), int(rng.integers(1, 48))
        tokens = rng.integers(0, int(rng.integers(2, 7)), size=(rows, width))
        lengths = rng.integers(1, width + 1, size=rows)
        yield tokens, lengths, k, min_n, max_n


@pytest.mark.parametrize("seed", range(4))
def test_device_lookup_gives_the_host_lookups_drafts(seed):
    """Row by row, the found drafts are the host proposer's."""
    checked = 0
    for tokens, lengths, k, min_n, max_n in _cases(seed, 250):
        drafts, found = ngram_lookup_ref(torch.tensor(tokens, dtype=torch.int32), torch.tensor(lengths), k, min_n,
                                         max_n)
        assert drafts.shape == (len(tokens), k) and found.shape == (len(tokens),)
        proposer = NgramProposer(k, min_n, max_n)
        for r in range(len(tokens)):
            expected = proposer.propose(tokens[r, :lengths[r]].astype(np.int64))
            assert drafts[r, :found[r]].tolist() == expected, (tokens[r, :lengths[r]], k, min_n, max_n)
            checked += bool(expected)
    assert checked > 100  # most rows found a match: the drafts themselves were compared, not only empty ones


def test_device_lookup_takes_the_latest_of_the_longest_matches():
    tokens = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 7, 2, 3, 8, 1, 2, 3]], dtype=torch.int32)
    drafts, found = ngram_lookup_ref(tokens, torch.tensor([14]), 3, 1, 3)
    assert found.tolist() == [3] and drafts.tolist() == [[7, 2, 3]]  # [1 2 3] last seen before 7 (not [2 3] -> 8)
    _, none = ngram_lookup_ref(tokens, torch.tensor([14]), 3, 4, 4)  # no 4-token match
    assert none.tolist() == [0]


@pytest.mark.parametrize("block", [4, 256])
def test_kernel_gives_the_references_drafts(device, block):
    """The kernel's drafts and counts are the reference's, for every row: found ones and the padding after them
    (the reference's own), over histories shorter and longer than a block (block 4: ends walked in many blocks),
    and rows read from a wider history (its stride), as the runner passes them."""
    found_any = 0
    for tokens, lengths, k, min_n, max_n in _cases(7 + block, 60):
        wide = torch.zeros(len(tokens), tokens.shape[1] + 5, dtype=torch.int32)
        wide[:, :tokens.shape[1]] = torch.tensor(tokens, dtype=torch.int32)
        history = wide[:, :tokens.shape[1]].to(device)
        num_tokens = torch.tensor(lengths, device=device)
        drafts, found = ngram_lookup_triton(history, num_tokens, k, min_n, max_n, block=block)
        ref_drafts, ref_found = ngram_lookup_ref(history, num_tokens, k, min_n, max_n)
        assert torch.equal(found.cpu(), ref_found.cpu()), (tokens, lengths, k, min_n, max_n)
        assert torch.equal(drafts.cpu(), ref_drafts.cpu()), (tokens, lengths, k, min_n, max_n)
        found_any += int((ref_found > 0).sum())
    assert found_any > 30


def test_kernel_refuses_what_it_cannot_read(device):
    with pytest.raises(ValueError, match="contiguous"):
        ngram_lookup_triton(torch.zeros(3, 8, dtype=torch.int32, device=device).t(), torch.ones(8, device=device),
                            2, 1, 3)
