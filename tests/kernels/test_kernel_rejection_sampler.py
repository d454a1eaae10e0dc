"""rejection_sample: the Triton kernel against the torch reference (the same noise bits, so the same tokens and
acceptances), across vocabularies that span several blocks, rows with no, some and all drafts, greedy (one-hot)
rows and rows whose target forbids the draft. The reference's distribution is tested in
tests/engine/test_spec_decode.py."""

import pytest
import torch

from kernels.rejection_sampler import rejection_sample_ref, rejection_sample_triton


def _inputs(rows: int, k: int, vocab: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(rows, k + 1, vocab, generator=gen), dim=-1)
    draft_ids = torch.randint(0, vocab, (rows, k), generator=gen)
    draft_ids[::3] = probs[::3, :k].argmax(dim=-1)  # likely drafts: long accepted runs
    probs[1::4] = torch.nn.functional.one_hot(probs[1::4].argmax(dim=-1), vocab).float()  # greedy rows
    probs[2, 0, draft_ids[2, 0]] = 0.0  # a draft the target never gives
    probs[2, 0] /= probs[2, 0].sum()
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    num_drafts[0] = k
    keys = torch.randint(0, 1 << 62, (rows, k + 1), generator=gen)
    return probs.to(device), draft_ids.to(device), num_drafts.to(device), keys.to(device)


@pytest.mark.parametrize("rows,k,vocab,block", [(12, 4, 50, 16), (9, 1, 300, 64), (16, 5, 1000, 256)])
def test_triton_matches_ref(rows, k, vocab, block, device, poisoned_allocations):
    args = _inputs(rows, k, vocab, device, seed=vocab)
    tokens, num_accepted = rejection_sample_triton(*args, block=block)
    ref_tokens, ref_accepted = rejection_sample_ref(*args)
    assert torch.equal(num_accepted, ref_accepted)
    assert torch.equal(tokens, ref_tokens)
    assert int(num_accepted.max()) > 0 and int((num_accepted < args[2]).sum()) > 0  # accepted and rejected runs
    assert int(num_accepted[2]) == 0 or int(args[2][2]) == 0  # a draft of probability 0 is never accepted


@pytest.mark.parametrize("rows,k,vocab,block", [(12, 4, 50, 16), (9, 2, 300, 64)])
def test_triton_matches_ref_with_draft_probabilities(rows, k, vocab, block, device, poisoned_allocations):
    """Drafts drawn from distributions q of their own (a draft model's sampled drafts): the kernel's acceptances and
    residual draws are the reference's."""
    probs, _, num_drafts, keys = _inputs(rows, k, vocab, device, seed=vocab + 1)
    gen = torch.Generator().manual_seed(vocab)
    q = torch.softmax(2 * torch.randn(rows, k, vocab, generator=gen), dim=-1)
    q[::3] = 0.5 * q[::3] + 0.5 * probs[::3, :k].cpu()  # close to the target: long accepted runs
    draft_ids = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(rows, k)
    q, draft_ids = q.to(device), draft_ids.to(device)
    tokens, num_accepted = rejection_sample_triton(probs, draft_ids, num_drafts, keys, q, block=block)
    ref_tokens, ref_accepted = rejection_sample_ref(probs, draft_ids, num_drafts, keys, q)
    assert torch.equal(num_accepted, ref_accepted)
    assert torch.equal(tokens, ref_tokens)
    assert int(num_accepted.max()) > 0 and int((num_accepted < num_drafts).sum()) > 0


def test_one_hot_draft_probabilities_are_the_default(device):
    """q one-hot at each draft, passed explicitly, gives exactly what no q gives: one rule for both."""
    probs, draft_ids, num_drafts, keys = _inputs(12, 4, 50, device, seed=3)
    one_hot = torch.nn.functional.one_hot(draft_ids, 50).float()
    for sample in (rejection_sample_ref, rejection_sample_triton):
        assert all(torch.equal(a, b) for a, b in zip(sample(probs, draft_ids, num_drafts, keys, one_hot),
                                                     sample(probs, draft_ids, num_drafts, keys)))


def test_bad_shapes_are_refused(device):
    probs, draft_ids, num_drafts, keys = _inputs(4, 2, 50, device)
    with pytest.raises(ValueError, match="draft_ids"):
        rejection_sample_triton(probs, draft_ids[:, :1], num_drafts, keys)
    with pytest.raises(ValueError, match="probs must be float32"):
        rejection_sample_triton(probs.double(), draft_ids, num_drafts, keys)
    with pytest.raises(ValueError, match="draft_probs must be float32"):
        rejection_sample_triton(probs, draft_ids, num_drafts, keys, probs)
