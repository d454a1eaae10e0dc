"""workers/spec_verify.py's verify on hand-made logits: greedy rows with and without knobs against a plain loop
(accept while the draft is the argmax, then the argmax) and log_softmax."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.sampling_params import SamplingParams
from workers.sampler import row_knobs
from workers.spec_verify import VerifyRow, logit_indices, verify


def _row(drafts, logprobs=None, **knobs):
    params = SamplingParams(temperature=0.0, max_tokens=50, logprobs=logprobs, **knobs)
    state = SimpleNamespace(req_id=str(len(drafts)), params=params, prompt_token_ids=[1, 2, 3], output_token_ids=[4],
                            knobs=row_knobs(params), num_pending=0, num_unsure=0)
    return VerifyRow(state, drafts, None)


def _expected(logits, rows):
    start, tokens = 0, []
    for row in rows:
        argmax = logits[start:start + len(row.drafts) + 1].argmax(-1).tolist()
        kept = []
        for j, d in enumerate(row.drafts):
            if argmax[j] != d:
                break
            kept.append(d)
        tokens.append(kept + [argmax[len(kept)]])
        start += len(row.drafts) + 1
    return tokens


@pytest.mark.parametrize("knob", [{}, {"logit_bias": {0: 0.0}}], ids=["plain", "a-knob-that-changes-nothing"])
def test_greedy_rows_accept_the_argmax_run_with_their_logprobs(knob):
    torch.manual_seed(0)
    logits = torch.randn(3 + 1 + 5 + 2, 40)
    argmax = logits.argmax(-1).tolist()
    # row 0: 2 drafts, both right; row 1: a plain decode row; row 2: 4 drafts, the 2nd wrong; row 3: 1 wrong draft
    rows = [_row(argmax[0:2], logprobs=3, **knob), _row([], logprobs=0, **knob),
            _row([argmax[4], (argmax[5] + 1) % 40, 7, 8], **knob), _row([(argmax[9] + 1) % 40], logprobs=1, **knob)]
    tokens, logprobs = verify(logits, rows, None)
    assert tokens == _expected(logits, rows)
    assert [len(t) for t in tokens] == [3, 1, 2, 1]
    lp = torch.log_softmax(logits, dim=-1)
    starts = [0, 3, 4, 9]
    for row, start, kept, lps in zip(rows, starts, tokens, logprobs):
        k = row.state.params.logprobs
        if k is None:
            assert lps == [None] * len(kept)
            continue
        for j, (t, got) in enumerate(zip(kept, lps)):
            assert got.sampled_logprob == pytest.approx(lp[start + j, t].item(), abs=1e-6)
            values, ids = lp[start + j].topk(k)
            assert got.top_token_ids == ids.tolist()
            assert got.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)


def test_logit_indices_are_each_sampling_rows_last_positions():
    counts, sample_rows, num_drafts = [5, 1, 3, 5, 2], [0, 1, 3, 4], [0, 0, 4, 1]
    ends = [4, 5, 8, 13, 15]
    expected = [p for r, d in zip(sample_rows, num_drafts) for p in range(ends[r] - d, ends[r] + 1)]
    assert logit_indices(counts, sample_rows, num_drafts).tolist() == expected == [4, 5, 9, 10, 11, 12, 13, 14, 15]
