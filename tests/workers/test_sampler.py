"""The batched sampler against its specification, on fixed logits vectors."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sampling_params import REPETITION_PENALTY_RANGE, SamplingParams
from workers.sampler import (
    SamplingRow,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    penalty_batch,
    sample,
    sample_async,
)
from workers.token_history import TokenHistory, apply_history_penalties

# probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (ids 0..5)
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = PROBS.log()


def _row(prompt=(), output=(), seed=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), seed)


def _draw(num: int, logits: torch.Tensor = LOGITS, seed: int = 0, **params) -> Counter:
    """Samples `num` rows of the same logits in one batch; counts the tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens, _ = sample(logits.repeat(num, 1), [_row(**params) for _ in range(num)], default_generator=generator)
    return Counter(tokens)


def test_empty_batch():
    assert sample(torch.empty(0, 6), []) == ([], [])


def test_unrestricted_sampling_follows_the_distribution():
    counts = _draw(20000)
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 20000 - p) < 0.015, (token, counts)


def test_temperature_zero_is_greedy_and_low_temperature_tends_to_it():
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 4.9]])
    assert sample(logits, [_row(temperature=0.0), _row(temperature=0.0)])[0] == [1, 0]
    assert set(_draw(200, logits[1], temperature=1e-3)) == {0}
    assert set(_draw(2000, logits[1], temperature=1.0)) == {0, 1, 2}


def test_top_k_keeps_exactly_k_tokens():
    kept = apply_top_k_top_p(LOGITS[None], torch.tensor([3]), torch.tensor([1.0]))
    assert torch.isfinite(kept).nonzero()[:, 1].tolist() == [0, 1, 2]
    assert set(_draw(3000, top_k=3)) == {0, 1, 2}
    assert set(_draw(100, top_k=1)) == {0}


def test_top_p_keeps_the_minimal_nucleus():
    def kept(p):
        out = apply_top_k_top_p(LOGITS[None], torch.tensor([0]), torch.tensor([p]))
        return torch.isfinite(out).nonzero()[:, 1].tolist()

    assert kept(0.3) == [0]
    assert kept(0.6) == [0, 1]  # 0.4 < 0.6 <= 0.65
    assert kept(0.7) == [0, 1, 2]
    assert kept(0.99) == [0, 1, 2, 3, 4, 5]
    counts = _draw(5000, top_p=0.6)
    assert set(counts) == {0, 1} and abs(counts[0] / 5000 - 0.4 / 0.65) < 0.03


def test_top_k_then_top_p_on_the_renormalized_distribution():
    # after top_k=2 the distribution is (0.615, 0.385): top_p=0.6 keeps only token 0
    out = apply_top_k_top_p(LOGITS[None], torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(out).nonzero()[:, 1].tolist() == [0]


def test_min_p_threshold():
    out = apply_min_p(LOGITS[None], torch.tensor([0.3]))  # threshold 0.3 * 0.4 = 0.12
    assert torch.isfinite(out).nonzero()[:, 1].tolist() == [0, 1, 2]
    assert set(_draw(3000, min_p=0.3)) == {0, 1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    out = apply_penalties(x.clone(), [_row(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_the_extreme_repetition_penalties_keep_logits_finite():
    """At the ends of the allowed range, with logits as large as a logit bias makes them: finite penalized
    logits, and a penalized token still sampled by its distribution (1e-40 gave inf, and token 0 every time)."""
    x = torch.tensor([[-100.0, 3.0, 100.0, 1.0]])
    low, high = REPETITION_PENALTY_RANGE
    for penalty in (low, high):
        out = apply_penalties(x.clone(), [_row(prompt=[0, 1, 2, 3], repetition_penalty=penalty)])
        assert torch.isfinite(out).all(), (penalty, out)
    assert set(_draw(200, logits=x[0], prompt=[0, 1, 2, 3], repetition_penalty=low)) == {2}
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=low / 2)


def test_frequency_and_presence_penalties_use_output_counts():
    x = torch.zeros(1, 4)
    row = _row(prompt=[3, 3], output=[0, 0, 0, 1], frequency_penalty=0.5, presence_penalty=0.25)
    assert apply_penalties(x, [row]).tolist() == [[-1.75, -0.75, 0.0, 0.0]]


def test_penalties_shift_the_distribution():
    base = _draw(4000, output=[0] * 3)
    penalized = _draw(4000, output=[0] * 3, frequency_penalty=1.0)
    assert penalized[0] < base[0] * 0.2  # logit - 3 => p(0) falls from 0.4 to ~0.03
    expected = 0.4 * math.exp(-3) / (0.4 * math.exp(-3) + 0.6)
    assert abs(penalized[0] / 4000 - expected) < 0.015


def _dense_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's definition on dense [V] masks and counts, a row at a time (the sampler's former implementation)."""
    out = x.clone()
    for i, row in enumerate(rows):
        p = row.params
        seen = torch.zeros(x.shape[1], dtype=torch.bool)
        seen[row.prompt_token_ids + row.output_token_ids] = True
        counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=x.shape[1]).float()
        r = torch.where(seen, torch.where(out[i] > 0, out[i] / p.repetition_penalty, out[i] * p.repetition_penalty),
                        out[i])
        out[i] = r - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return out


def _penalty_rows(vocab: int = 30) -> list[SamplingRow]:
    """Rows whose prompts and outputs repeat tokens and share them, under every mix of penalties."""
    gen = torch.Generator().manual_seed(0)
    settings = [dict(repetition_penalty=1.7), dict(frequency_penalty=0.6), dict(presence_penalty=-0.9), {},
                dict(repetition_penalty=0.6, frequency_penalty=-0.4, presence_penalty=1.1),
                dict(frequency_penalty=1.3, presence_penalty=0.2), dict(repetition_penalty=1.2)]
    rows = []
    for i, penalties in enumerate(settings):
        prompt = torch.randint(0, vocab, (1 + 3 * i,), generator=gen).tolist()
        output = torch.randint(0, vocab // 2, (0 if i == 6 else 9 - i,), generator=gen).tolist()  # repeats
        rows.append(_row(prompt, output, **penalties))
    return rows


def test_penalties_from_host_lists_and_from_the_device_history_follow_the_definition():
    rows, vocab = _penalty_rows(), 30
    x = 3 * torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1))
    expected = _dense_penalties(x, rows)
    from_lists = apply_penalties(x.clone(), rows)
    torch.testing.assert_close(from_lists, expected, rtol=0, atol=1e-5)  # frequency: one subtraction a repeat

    # As the runner keeps them: slots (a freed one reused, stale tokens past its length), prompts copied once,
    # outputs appended step by step on the device.
    history = TokenHistory(max_num_seqs=8, max_model_len=40, device=torch.device("cpu"))
    history.remove(history.add(list(range(39)), [1]))
    tensors = SamplingTensors.build(rows, vocab, torch.device("cpu"))
    slots = [history.add(rows[i].prompt_token_ids, []) for i in tensors.penalty_rows]
    for step in range(max(len(rows[i].output_token_ids) for i in tensors.penalty_rows)):
        now = [(slot, rows[i].output_token_ids[step]) for slot, i in zip(slots, tensors.penalty_rows)
               if step < len(rows[i].output_token_ids)]
        history.append(torch.tensor([s for s, _ in now]), torch.tensor([[t] for _, t in now]))
    batch = penalty_batch(tensors, *history.read(torch.tensor(slots), max_tokens=40))
    assert torch.equal(apply_history_penalties(x.clone(), batch), from_lists)


def test_sample_with_device_penalties_and_in_place_logits():
    rows = _penalty_rows()
    for row in rows:
        row.params = SamplingParams(temperature=0.0, repetition_penalty=row.params.repetition_penalty,
                                    frequency_penalty=row.params.frequency_penalty,
                                    presence_penalty=row.params.presence_penalty, logprobs=1)
    x = 3 * torch.randn(len(rows), 30, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = sample(x, rows)
    assert tokens == _dense_penalties(x, rows).argmax(dim=-1).tolist()
    owned = x.clone()
    tensors = SamplingTensors.build(rows, 30, x.device)
    batch = sample_async(owned, rows, tensors=tensors, in_place=True)
    assert batch.tokens.tolist() == tokens
    assert not torch.equal(owned, x)  # penalized in place...
    expected = torch.log_softmax(x, -1)  # ...but logprobs still come from the raw logits
    for i, lp in enumerate(logprobs):
        assert lp.sampled_logprob == pytest.approx(expected[i, tokens[i]].item(), abs=1e-6)
    assert batch.sampled_logprobs.tolist() == pytest.approx([lp.sampled_logprob for lp in logprobs], abs=1e-6)


def test_logit_bias_forces_a_token():
    assert set(_draw(200, logit_bias={5: 100.0})) == {5}
    assert sample(LOGITS[None], [_row(temperature=0.0, logit_bias={4: 20.0})])[0] == [4]


def test_allowed_token_ids_restrict_their_row_only():
    counts = _draw(500, allowed_token_ids=[3, 5])
    assert set(counts) == {3, 5} and counts[3] > counts[5]  # 0.1 against 0.04, renormalized
    rows = [_row(temperature=0.0, allowed_token_ids=[4]), _row(temperature=0.0), _row(temperature=0.0, top_k=2,
                                                                                      allowed_token_ids=[2, 5])]
    tokens, _ = sample(LOGITS.repeat(3, 1), rows)
    assert tokens == [4, 0, 2]
    # with logit_bias and min_tokens: the mask holds; a stop token that is all it allows is still sampled
    assert sample(LOGITS[None], [_row(temperature=0.0, allowed_token_ids=[1, 2], logit_bias={0: 100.0})])[0] == [1]
    stuck = _row(temperature=0.0, allowed_token_ids=[5], min_tokens=3, all_stop_token_ids=(5,), output=[1])
    assert sample(LOGITS[None], [stuck])[0] == [5]


def test_min_tokens_blocks_stop_tokens():
    params = dict(temperature=0.0, min_tokens=2, all_stop_token_ids=(0, 1))
    assert sample(LOGITS[None], [_row(output=[3], **params)])[0] == [2]
    assert sample(LOGITS[None], [_row(output=[3, 3], **params)])[0] == [0]
    assert 0 not in _draw(500, output=[], min_tokens=1, all_stop_token_ids=(0,))


def test_min_tokens_counts_what_the_verify_step_in_flight_kept():
    """A row sampled while a verify step of it is in flight counts its 2 drafts as accepted (num_pending 3: a token
    and 2 drafts, num_unsure 2); key_shift, on the device, says how many that step rejected: 1 output before and
    min_tokens 3, the row is short (its stop token blocked) only where it lost 2 of them, greedy or seeded; a row
    short whatever the shift stays blocked, one with none unsure is not moved by a shift."""
    params = dict(min_tokens=3, all_stop_token_ids=(0,))
    for temperature, seed in ((0.0, None), (0.7, 77)):
        rows = [SamplingRow(SamplingParams(temperature=temperature, **params), [], [3], seed, num_pending=3,
                            num_unsure=2) for _ in range(3)]
        rows.append(_row(output=[3], temperature=temperature, seed=seed, **params))  # short whatever the shift
        rows.append(_row(output=[3, 3, 3], temperature=temperature, seed=seed, **params))  # met, none unsure
        logits = LOGITS.clone()
        logits[0] = 50.0  # the stop token: taken wherever it is not blocked
        shift = torch.tensor([0, 1, 2, 2, 2])
        tokens = sample_async(logits.repeat(5, 1), rows, key_shift=shift).tokens.tolist()
        assert [t == 0 for t in tokens] == [True, True, False, False, True], (temperature, tokens)


def test_min_tokens_yields_where_only_stop_tokens_are_left():
    """A row whose every other token is -inf (a grammar that allows only its end) samples a stop token rather
    than from an empty distribution; the row beside it still has its stop tokens blocked."""
    only_stop = torch.full_like(LOGITS, float("-inf"))
    only_stop[[4, 5]] = LOGITS[[4, 5]]
    params = dict(min_tokens=3, all_stop_token_ids=(4, 5))
    for temperature in (0.0, 1.0):
        rows = [_row(output=[3], temperature=temperature, **params) for _ in range(2)]
        tokens, _ = sample(torch.stack([only_stop, LOGITS]), rows, torch.Generator().manual_seed(0))
        assert tokens[0] in (4, 5) and tokens[1] not in (4, 5)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))

    def seeded_tokens(rows_before: int, steps: int = 20) -> list[int]:
        tokens = []
        for step in range(steps):
            rows = [_row(temperature=0.8) for _ in range(rows_before)]
            rows.append(_row(temperature=0.8, top_p=0.9, seed=1234 * 1000 + step))
            rows.append(_row(temperature=0.0))
            batch = torch.cat([logits[:rows_before], logits[4:5], logits[:1]])
            tokens.append(sample(batch, rows)[0][rows_before])
        return tokens

    alone = seeded_tokens(0)
    assert alone == seeded_tokens(3) == seeded_tokens(1)
    assert len(set(alone)) > 1  # really random


def test_mixed_greedy_and_random_rows():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]])
    rows = [_row(temperature=0.0), _row(temperature=1.0, top_k=1), _row(temperature=0.0)]
    assert sample(logits, rows)[0] == [1, 2, 0]


def test_logprobs_come_from_the_raw_logits():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    rows = [_row(temperature=0.0, logprobs=3, repetition_penalty=1.5, prompt=[0, 1, 2]),
            _row(logprobs=0, temperature=0.5, top_k=2),
            _row()]
    tokens, logprobs = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    first = logprobs[0]
    assert first.sampled_logprob == pytest.approx(expected[0, tokens[0]].item(), abs=1e-6)
    top = expected[0].topk(3)
    assert first.top_token_ids == top.indices.tolist()
    assert first.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert logprobs[1].top_token_ids == [] and logprobs[1].top_logprobs == []
    assert logprobs[1].sampled_logprob == pytest.approx(expected[1, tokens[1]].item(), abs=1e-6)
    assert logprobs[2] is None


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 17, 64])
def test_sampling_tensors_start_aligned_whatever_the_batch(num_rows):
    """Each knob tensor starts on a 16-byte boundary: Triton compiles the sampling kernel once per alignment of its
    pointers, and a batch size that moved them compiled a new variant while the step waited."""
    from workers.sampler import SamplingTensors

    rows = [SamplingRow(SamplingParams(temperature=0.5 + i / 10, top_k=i % 3), [1], []) for i in range(num_rows)]
    tensors = SamplingTensors.build(rows, 100, torch.device("cpu"))
    for name in ("inv_temperature", "noise_scale", "top_p", "log_min_p", "top_k"):
        t = getattr(tensors, name)
        assert t.shape == (num_rows,) and t.data_ptr() % 16 == 0, name
    assert tensors.top_k.tolist() == [i % 3 for i in range(num_rows)]
    assert tensors.inv_temperature.tolist() == pytest.approx([1 / (0.5 + i / 10) for i in range(num_rows)])
