"""sample_tokens: the Triton kernel against the torch reference (the same noise bits, so the same tokens), and the
reference against the definitions: samples inside the top-k / top-p / min-p masks, at the renormalized
frequencies."""

import math
from collections import Counter

import pytest
import torch

from kernels.sampling import gumbel_ref, sample_ref, sample_tokens, sample_triton
from workers.sampler import apply_min_p, apply_top_k_top_p

NEG_INF = float("-inf")
SETTINGS = [  # (temperature, top_k, top_p, min_p); temperature 0: greedy
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 50, 1.0, 0.0), (0.7, 50, 0.9, 0.0),
    (1.0, 0, 0.3, 0.0), (1.0, 0, 1.0, 0.05), (0.5, 7, 0.8, 0.1), (2.0, 1, 1.0, 0.0), (1.0, 0, 0.05, 0.0),
]


def knobs(settings, x: torch.Tensor, seed: int = 0):
    """The kernel's per-row arguments for rows of (temperature, top_k, top_p, min_p)."""
    inv_t, noise, top_p, log_min_p, kth = [], [], [], [], []
    for row, (temperature, k, p, min_p) in zip(x, settings):
        greedy = temperature == 0
        inv_t.append(1.0 if greedy else 1 / temperature)
        noise.append(0.0 if greedy else 1.0)
        top_p.append(1.0 if greedy else p)
        log_min_p.append(math.log(min_p) if min_p and not greedy else NEG_INF)
        kth.append(row.topk(min(k, row.numel())).values[-1].item() if k and not greedy else NEG_INF)
    keys = torch.randint(0, 1 << 62, (len(settings),), generator=torch.Generator().manual_seed(seed))
    as_f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=x.device)  # noqa: E731
    return as_f32(inv_t), as_f32(kth), as_f32(top_p), as_f32(log_min_p), as_f32(noise), keys.to(x.device)


def logits(rows: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(rows, vocab, generator=gen)
    x[0, 5] = NEG_INF  # a banned token (min_tokens, logit bias)
    return x.to(device)


@pytest.mark.parametrize("vocab,block", [(50, 16), (300, 64), (1000, 256)])
def test_triton_matches_ref(vocab, block, device, poisoned_allocations):
    settings = SETTINGS * 2
    x = logits(len(settings), vocab, device, seed=vocab)
    args = knobs(settings, x, seed=vocab)
    got = sample_triton(x, *args, block=block)  # several blocks per row, the last one partial
    assert torch.equal(got, sample_ref(x, *args))
    assert got[0].item() == x[0].argmax().item()  # greedy: the first argmax


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(device):
    """top_p 5e-324 is valid (in (0, 1]) and is 0 in float32: the nucleus is the most likely token alone. (It was
    rejected too, and the next round found no candidate at all: token 0, banned here as a grammar's mask bans it.)
    Peaked rows draw the most likely token first, so with few rounds left the old behaviour shows at once."""
    settings = [(0.1, 0, 5e-324, 0.0), (0.05, 0, 5e-324, 0.0), (0.1, 7, 5e-324, 0.0), (0.1, 0, 1e-30, 0.1)] * 4
    x = logits(len(settings), 300, device, seed=3)
    x[:, 0] = NEG_INF
    args = knobs(settings, x)
    assert args[2].eq(0).sum() >= 12
    for max_rounds in (2, 3, 32):
        for sample in (sample_triton, sample_ref):
            assert torch.equal(sample(x, *args, max_rounds=max_rounds), x.argmax(dim=-1)), (sample, max_rounds)


def test_triton_single_block_and_one_round(device):
    x = logits(len(SETTINGS), 37, device, seed=1)
    args = knobs(SETTINGS, x)
    assert torch.equal(sample_triton(x, *args), sample_ref(x, *args))  # one block covers the row
    # One round: no retry is left, so every row takes its argmax (always in the nucleus).
    last = sample_triton(x, *args, max_rounds=1)
    assert torch.equal(last, sample_ref(x, *args, max_rounds=1))
    assert torch.equal(last, x.argmax(dim=-1))


def test_a_subset_holding_the_candidates_draws_what_the_whole_row_draws(device):
    """Top-k rows read their largest logits only; the others, and a row whose ties at the k-th logit run past the
    subset, read the whole row: every row draws what it draws without a subset."""
    settings = SETTINGS * 2
    x = logits(len(settings), 400, device, seed=5)
    x[4, :60] = 7.0  # row 4 (top_k 50): 60 logits tie at its 50th, past a subset of 56
    args = knobs(settings, x, seed=5)
    full = sample_triton(x, *args, block=128)
    subset = x.topk(56, dim=-1)
    assert torch.equal(sample_triton(x, *args, subset, block=128), full)
    assert torch.equal(sample_ref(x, *args, subset), full)  # falls back to the whole rows: one row's ties
    top_k_rows = [i for i, s in enumerate(settings) if s[0] and s[1] and i != 4]
    rows = torch.tensor(top_k_rows)
    only = [a[rows] for a in args]
    assert torch.equal(sample_ref(x[rows], *only, (subset[0][rows], subset[1][rows])), full[rows])
    assert subset.values[4, -1].item() == 7.0 and x[4, full[4]].item() >= 7.0  # the whole row, a candidate


def test_a_subset_wider_than_one_load_draws_what_the_whole_row_draws(device):
    """A top_k past SUB_BLOCK: its subset is read a load at a time, and any subset width runs the one compiled
    variant (the width is not specialized on)."""
    from kernels.sampling import SUB_BLOCK

    settings = [(1.0, SUB_BLOCK + 72, 1.0, 0.0), (0.8, SUB_BLOCK + 72, 0.9, 0.0), (1.0, 3, 1.0, 0.0)] * 3
    x = logits(len(settings), 2048, device, seed=9)
    args = knobs(settings, x, seed=9)
    full = sample_triton(x, *args)
    for width in (SUB_BLOCK + 104, SUB_BLOCK + 105, 3 * SUB_BLOCK):
        subset = x.topk(width, dim=-1)
        assert torch.equal(sample_triton(x, *args, subset), full), width
        assert torch.equal(sample_ref(x, *args, subset), full), width


def test_inputs_are_checked():
    x = torch.zeros(2, 8)
    args = knobs(SETTINGS[:2], x)
    with pytest.raises(ValueError, match="x must have dtype"):
        sample_tokens(x.half(), *args)
    with pytest.raises(ValueError, match="top_p must be"):
        sample_tokens(x, args[0], args[1], args[2][:1], *args[3:])
    with pytest.raises(ValueError, match="keys must have dtype"):
        sample_tokens(x, *args[:5], args[5].int())
    with pytest.raises(ValueError, match="subset must be"):
        sample_tokens(x, *args, (torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long)))


def _kept(x: torch.Tensor, temperature: float, k: int, p: float, min_p: float) -> list[int]:
    """The tokens the masks' definitions keep (a full sort; the sampler's former implementation)."""
    z = x[None] / temperature
    z = apply_top_k_top_p(z, torch.tensor([k]), torch.tensor([p]))
    z = apply_min_p(z, torch.tensor([min_p]))
    return torch.isfinite(z[0]).nonzero()[:, 0].tolist()


@pytest.mark.parametrize("temperature,k,p,min_p", [(1.0, 0, 0.6, 0.0), (0.7, 3, 0.7, 0.0), (1.0, 0, 1.0, 0.2),
                                                   (1.5, 0, 0.8, 0.05), (1.0, 4, 0.95, 0.3), (1.0, 2, 1.0, 0.0)])
def test_ref_draws_inside_the_masks_at_the_renormalized_frequencies(temperature, k, p, min_p):
    probs = torch.tensor([0.3, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02])
    x = probs.log()
    num = 20000
    rows = x.repeat(num, 1)
    tokens = sample_ref(rows, *knobs([(temperature, k, p, min_p)] * num, rows, seed=7))
    kept = _kept(x, temperature, k, p, min_p)
    target = torch.zeros_like(probs)
    target[kept] = torch.softmax(x / temperature, -1)[kept]
    target /= target.sum()
    counts = Counter(tokens.tolist())
    assert set(counts) == set(kept)
    for t in kept:
        sigma = math.sqrt(target[t] * (1 - target[t]) / num)
        assert abs(counts[t] / num - target[t].item()) < 5 * sigma + 1e-3, (t, counts, target)


def test_triton_draws_follow_the_distribution(device):
    """The kernel itself (interpreted on CPU: fewer rows) at a setting that needs rejection rounds."""
    probs = torch.tensor([0.3, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02])
    num = 200
    rows = probs.log().repeat(num, 1).to(device)
    tokens = sample_triton(rows, *knobs([(1.0, 0, 0.6, 0.0)] * num, rows, seed=3)).tolist()
    counts = Counter(tokens)
    assert set(counts) == {0, 1, 2}  # 0.3 + 0.22 < 0.6 <= 0.3 + 0.22 + 0.15
    for t, p in zip((0, 1, 2), (0.3 / 0.67, 0.22 / 0.67, 0.15 / 0.67)):
        assert abs(counts[t] / num - p) < 5 * math.sqrt(p * (1 - p) / num), counts


def test_ties_at_the_top_k_threshold_all_stay():
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    rows = x.repeat(3000, 1)
    tokens = set(sample_ref(rows, *knobs([(1.0, 2, 1.0, 0.0)] * 3000, rows)).tolist())
    assert tokens == {0, 1, 2, 3}  # the 2nd largest logit is tied three ways


def test_gumbel_noise_is_uniform_across_tokens_and_keys():
    keys = torch.randint(0, 1 << 62, (4000,), generator=torch.Generator().manual_seed(0))
    g = gumbel_ref(keys, torch.arange(64)[None, :])
    u = torch.exp(-torch.exp(-g))  # back to the uniform draw
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # neighbouring tokens and neighbouring keys are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1].item()) < 0.05
    near = gumbel_ref(keys + 1, torch.arange(64)[None, :])
    assert abs(torch.corrcoef(torch.stack([g.flatten(), near.flatten()]))[0, 1].item()) < 0.02
    counts = Counter(g.argmax(dim=-1).tolist())  # Gumbel-max over equal logits: uniform
    assert len(counts) == 64 and max(counts.values()) < 4000 / 64 * 1.6


@pytest.mark.gpu
def test_triton_matches_ref_at_llama3_size(cuda):
    """256 rows of a 128k vocabulary on the GPU: the kernel's fast exp and log may move a near-tie or a top-p
    boundary by an ulp, so a few rows in a thousand may differ."""
    settings = (SETTINGS * 26)[:256]
    x = logits(256, 128256, cuda)
    args = knobs(settings, x)
    got, ref = sample_tokens(x, *args), sample_ref(x, *args)
    assert (got == ref).float().mean().item() > 0.99
    assert torch.equal(got[0], x[0].argmax())
