"""apply_token_bitmask_: the reference against xgrammar's own CPU kernel and a per-token loop, the Triton kernel
against the reference, across vocabularies that cross word (32) and block (2048) boundaries."""

import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref, apply_token_bitmask_triton


def make_case(num_rows, vocab, masked_rows, dtype=torch.float32, extra_words=0, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen).to(dtype)
    words = -(-vocab // 32) + extra_words
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(masked_rows), words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = 0  # a word with nothing allowed
    if len(masked_rows) > 1:
        bitmask[1, -1] = -1  # a word with everything allowed
    rows = torch.tensor(masked_rows, dtype=torch.int32)
    return logits.to(device), bitmask.to(device), rows.to(device)


def test_ref_matches_a_per_token_loop_and_xgrammar():
    import xgrammar

    logits, bitmask, rows = make_case(5, 100, [3, 0])
    ref = logits.clone()
    apply_token_bitmask_ref(ref, bitmask, rows)
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(100):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    assert torch.equal(ref, expected)
    assert torch.equal(ref[[1, 2, 4]], logits[[1, 2, 4]])  # rows without a mask are untouched
    theirs = logits.clone()
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)  # xgrammar's bitmask has a row per logits row
    full[rows.long()] = bitmask
    xgrammar.apply_token_bitmask_inplace(theirs, full, indices=rows.tolist(), backend="cpu")
    assert torch.equal(ref, theirs)


@pytest.mark.parametrize("vocab, extra_words", [(1, 0), (31, 1), (33, 0), (2047, 1), (2049, 0), (5000, 0),
                                                (5000, -100), (4200, -66)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_ref(vocab, extra_words, dtype, device):
    """Bitmasks as wide as the vocabulary, wider, and narrower (a tokenizer smaller than the model's vocabulary)."""
    logits, bitmask, rows = make_case(4, vocab, [2, 0, 3], dtype, extra_words, seed=vocab, device=device)
    ref, out = logits.clone(), logits.clone()
    apply_token_bitmask_ref(ref, bitmask, rows)
    apply_token_bitmask_triton(out, bitmask, rows)
    assert torch.equal(out, ref)
    assert torch.equal(out[1], logits[1])


def test_public_function_and_empty_mask(device):
    logits, bitmask, rows = make_case(3, 70, [1], device=device)
    out = logits.clone()
    apply_token_bitmask_(out, bitmask[:0], rows[:0])
    assert torch.equal(out, logits)
    apply_token_bitmask_(out, bitmask, rows)
    ref = logits.clone()
    apply_token_bitmask_ref(ref, bitmask, rows)
    assert torch.equal(out, ref)


def test_tokens_past_a_narrow_bitmask_are_never_allowed():
    logits, bitmask, rows = make_case(2, 100, [1], extra_words=-2)  # 2 words: tokens 0..63
    bitmask[:] = -1
    apply_token_bitmask_ref(logits, bitmask, rows)
    assert torch.isfinite(logits[1, :64]).all() and torch.isinf(logits[1, 64:]).all()


def test_bad_shapes_are_rejected():
    logits, bitmask, rows = make_case(2, 100, [0])
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask_ref(logits, bitmask[:, :0], rows)
    with pytest.raises(ValueError, match="rows must be"):
        apply_token_bitmask_ref(logits, bitmask, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="bitmask must have dtype"):
        apply_token_bitmask_ref(logits, bitmask.long(), rows)


@pytest.mark.gpu
def test_triton_at_llama_3_vocab_on_gpu(cuda):
    logits, bitmask, rows = make_case(256, 128256, list(range(0, 256, 2)), device=cuda)
    ref, out = logits.clone(), logits.clone()
    apply_token_bitmask_ref(ref, bitmask, rows)
    apply_token_bitmask_triton(out, bitmask, rows)
    assert torch.equal(out, ref)
