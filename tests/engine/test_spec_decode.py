"""Speculative decoding (#34): the n-gram proposer, the config, and the engine with speculation against the engine
without it. Greedy: the same tokens, logprobs and finish reasons, whatever was accepted; sampling: the same token
distributions (chi-square over seeded draws). Acceptance is forced where the tiny model's gibberish gives the n-gram
proposer nothing to find: an oracle proposer that proposes the non-speculative output, with every few drafts wrong."""

import argparse

import numpy as np
import pytest
import torch
from scipy import stats

from engine import SamplingParams
from engine.arg_utils import add_engine_args, engine_args
from engine.config import EngineArgs, SpeculativeConfig
from engine.errors import ParamError
from engine.spec_decode import NgramProposer
from kernels.rejection_sampler import greedy_accept_ref, rejection_sample_ref
from tests.spec_proposers import OracleLookup, OracleProposer

# Speculating in every step whatever it costs (a batch limit above any batch here): tests that count drafts must not
# depend on the machine's step times, which the engine's own decision reads (tested on its own below).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 4096}


# ---- config ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "speculative_config.lookahead"),
    ({"method": "medusa2", "num_speculative_tokens": 4}, "speculative_config.method"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min"),
    ([1, 2], "speculative_config"),
])
def test_bad_speculative_configs_are_refused_naming_the_key(bad, field):
    with pytest.raises(ParamError) as e:
        EngineArgs(speculative_config=bad)
    assert e.value.param == field
    if bad == {"method": "eagle", "num_speculative_tokens": 4}:
        assert "not built" in str(e.value)


def test_speculative_config_from_the_cli_and_the_defaults():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                                  '"prompt_lookup_max": 2}']))
    assert SpeculativeConfig.from_dict(args.speculative_config) == SpeculativeConfig("ngram", 3, 1, 2)
    assert SpeculativeConfig.from_dict(NGRAM).disable_by_batch_size == 4096
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 6}) == \
        SpeculativeConfig("ngram", 2, 6, 6)
    assert SpeculativeConfig.from_dict(None) is None
    with pytest.raises(SystemExit):  # argparse: not JSON
        parser.parse_args(["--speculative-config", "ngram"])


def test_serve_app_args_take_the_speculative_config():
    from cluster.app import ModelArgs

    args = ModelArgs(model="tiny", speculative_config=NGRAM)
    assert args.engine.speculative_config == NGRAM
    with pytest.raises(ValueError, match="speculative_config.method"):
        ModelArgs(model="tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 2})


# ---- proposer --------------------------------------------------------------------------------------------------------
def _ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, one position at a time."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("search", ["bytes", "numpy"])
@pytest.mark.parametrize("values", [(0, 1, 2, 3), (0, 256, 65536, 65792, 1 << 24)], ids=["small", "byte-aligned"])
def test_ngram_proposer_finds_the_latest_longest_match(monkeypatch, search, values):
    """Both searches (bytes.rfind at token boundaries up to BYTES_MAX_TOKENS tokens, numpy past it) against the
    definition; token values whose int32 bytes repeat across token boundaries (0, 256, 65536, ...) make the byte
    search find occurrences inside tokens, which must not count."""
    if search == "numpy":
        monkeypatch.setattr(NgramProposer, "BYTES_MAX_TOKENS", 0)
    proposer = NgramProposer(3, 1, 3)
    seq = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert proposer.propose(seq) == [7, 8, 5]  # "2 3" last seen before 7 8 5 (longest n = 3: "5 2 3" not seen)
    assert proposer.propose(np.array([4, 4])) == [4]
    assert proposer.propose(np.array([1, 2, 3])) == []
    assert proposer.propose(np.array([7])) == []
    rng = np.random.default_rng(0)
    for _ in range(600):
        tokens = [values[i] for i in rng.integers(0, len(values), size=rng.integers(1, 40))]
        k, min_n = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        max_n = min_n + int(rng.integers(0, 3))
        got = NgramProposer(k, min_n, max_n).propose(np.array(tokens, dtype=np.int64))
        assert got == _ngram_reference(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


def test_token_arrays_follow_each_request():
    """The n-gram lookup's arrays: a request's prompt and outputs, extended as it grows (past the buffer's first
    size too), rebuilt when its output was cut or it is another request object, dropped when it stops running."""
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.spec_decode import TokenArrays

    arrays = TokenArrays()
    req = Request("a", list(range(40)), SamplingParams(), max_tokens=200)
    assert arrays.get(req).tolist() == list(range(40))
    for t in range(100):
        req.output_token_ids.append(1000 + t)
        if t % 7 == 0:
            assert arrays.get(req).tolist() == req.all_token_ids
    del req.output_token_ids[-5:]  # a stop string cut the output
    assert arrays.get(req).tolist() == req.all_token_ids
    other = Request("a", [5, 6, 7], SamplingParams(), max_tokens=8)  # the same id, another request
    assert arrays.get(other).tolist() == [5, 6, 7]
    arrays.keep_only({"b"})
    assert not arrays.arrays


# ---- the rejection sampler -------------------------------------------------------------------------------------------
def _assert_tokens_follow(p: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """The first token of every row follows p[0], and the second, where the first draft was accepted, follows p[1]
    (chi-square goodness of fit; never a token p[1] gives probability 0)."""
    rows, vocab = tokens.shape[0], p.shape[1]
    expected = p.double().numpy()
    first = torch.bincount(tokens[:, 0], minlength=vocab).numpy()
    assert stats.chisquare(first, expected[0] / expected[0].sum() * rows).pvalue > 1e-3
    after = tokens[num_accepted >= 1, 1]
    second = torch.bincount(after, minlength=vocab).numpy()
    keep = expected[1] > 0
    assert second[~keep].sum() == 0
    assert stats.chisquare(second[keep], expected[1][keep] / expected[1].sum() * len(after)).pvalue > 1e-3


def test_rejection_sampler_keeps_the_target_distribution():
    """Row after row of one target and one pair of drafts: the first token follows p_0, and the second, where the
    first draft was accepted, follows p_1 (chi-square goodness of fit)."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 6, 40_000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)
    p[1, 4] = 0.0  # a token the target never gives (top-k / top-p cut it)
    p[1] /= p[1].sum()
    probs = p[None].expand(rows, 3, vocab).contiguous()
    drafts = torch.tensor([[2, 4]]).expand(rows, 2).contiguous()
    keys = torch.randint(0, 1 << 62, (rows, 3), generator=gen)
    tokens, num_accepted = rejection_sample_ref(probs, drafts, torch.full((rows,), 2), keys)
    assert 0 < int((num_accepted > 0).sum()) < rows
    assert not bool(((tokens[:, 1] == 4) & (num_accepted == 1)).any())  # draft 4 is never accepted at p = 0
    _assert_tokens_follow(p, tokens, num_accepted)


def test_rejection_sampler_keeps_the_target_distribution_with_sampled_drafts():
    """Drafts drawn from draft distributions q (a draft model's sampled drafts) and accepted with min(1, p / q), the
    residual max(p - q, 0) drawn on a rejection: the first token follows p_0, and the second, where the first draft
    was accepted, follows p_1 (chi-square)."""
    gen = torch.Generator().manual_seed(1)
    vocab, rows = 6, 40_000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)
    p[1, 4] = 0.0  # a token the target never gives: a draft of it is always rejected
    p[1] /= p[1].sum()
    q = torch.softmax(torch.randn(2, vocab, generator=gen), dim=-1)  # another model's distributions
    probs = p[None].expand(rows, 3, vocab).contiguous()
    draft_probs = q[None].expand(rows, 2, vocab).contiguous()
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(rows, 2)
    keys = torch.randint(0, 1 << 62, (rows, 3), generator=gen)
    tokens, num_accepted = rejection_sample_ref(probs, drafts, torch.full((rows,), 2), keys, draft_probs)
    assert 0 < int((num_accepted > 0).sum()) < rows and int((num_accepted == 2).sum()) > 0
    assert not bool(((tokens[:, 1] == 4) & (num_accepted >= 1)).any())
    _assert_tokens_follow(p, tokens, num_accepted)


def test_rejection_sampler_greedy_rows_take_the_argmax_run():
    one_hot = torch.nn.functional.one_hot(torch.tensor([[3, 1, 2], [3, 1, 2]]), 5).float()
    tokens, num_accepted = rejection_sample_ref(one_hot, torch.tensor([[3, 1], [3, 4]]), torch.tensor([2, 2]),
                                                torch.zeros(2, 3, dtype=torch.long))
    assert tokens.tolist() == [[3, 1, 2], [3, 1, -1]]
    assert num_accepted.tolist() == [2, 1]
    fast, fast_accepted = greedy_accept_ref(torch.tensor([[3, 1, 2], [3, 1, 2]]), torch.tensor([[3, 1], [3, 4]]),
                                            torch.tensor([2, 2]))
    assert torch.equal(fast, tokens) and torch.equal(fast_accepted, num_accepted)


# ---- the engine ------------------------------------------------------------------------------------------------------
def _llm(**kwargs):
    from pagoda import LLM

    return LLM(**({"model": "tiny", "device": "cpu", "num_kv_blocks": 64, "block_size": 4} | kwargs))


def _run(prompts, params, oracle_k: int | None = None, references=None, on_device: bool = False, **kwargs):
    """(outputs, the engine) of one offline run; with oracle_k, speculative with the oracle proposer: on the driver
    (each verify step read back before the next is launched), or on_device, in the runner's place of the n-gram
    lookup (steps launched ahead of the verify step in flight, their inputs fixed up on the device)."""
    llm = _llm(**kwargs)
    if oracle_k is not None:
        assert llm.engine.spec is not None
        if on_device:
            llm.engine.executor.worker.runner.lookup = OracleLookup(references, oracle_k)
        else:
            llm.engine.spec.proposer = OracleProposer(references, oracle_k)
        _check_every_step(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    llm.shutdown()
    return outs, llm.engine


def _check_every_step(engine) -> None:
    """The engine's books (the workers' block tables against the driver's too) checked after each of its steps."""
    step = engine.step

    def checked_step():
        deltas = step()
        engine.check_integrity()
        return deltas

    engine.step = checked_step


def _assert_same(plain, spec, atol=1e-4):  # float32: a recomputed KV (preemption) moves the last bits
    for a, b in zip(plain, spec):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason)
            if x.logprobs is not None:
                for la, lb in zip(x.logprobs, y.logprobs):
                    assert la.keys() == lb.keys()
                    for t in la:
                        assert la[t] == pytest.approx(lb[t], abs=atol)


def _references(prompts, outs):
    return [(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs]


PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [1, 2, 3, 4] * 5, [11, 12, 13], list(range(20, 61))]


@pytest.mark.parametrize("on_device", [False, True], ids=["host-drafts", "device-drafts"])
@pytest.mark.parametrize("engine_kwargs", [
    {},  # continuous batching: the fourth prompt is not speculated (the oracle does not know it)
    {"max_num_batched_tokens": 7},  # chunked prefill, and drafts trimmed to the token budget
    {"num_kv_blocks": 26, "enable_prefix_caching": False},  # preemption
])
def test_greedy_speculation_gives_the_plain_output(engine_kwargs, on_device):
    """Drafts on the driver run pipelined; drafts on the device run ahead: each verify step is launched before the
    one in flight is read back, the runner moving its inputs back by the drafts that one rejected."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (37, 40, 23, 30)]
    plain, _ = _run(PROMPTS, params, **engine_kwargs)
    references = _references(PROMPTS, plain)[:3]
    spec, engine = _run(PROMPTS, params, 4, references, on_device, speculative_config=NGRAM, **engine_kwargs)
    _assert_same(plain, spec)
    stats_ = engine.scheduler.spec_stats
    assert stats_.num_accepted_tokens > 0 and stats_.num_accepted_tokens < stats_.num_draft_tokens
    assert (engine.spec.num_steps_ahead > 10) == on_device
    if "num_kv_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_caching_with_speculation():
    """Blocks filled by rejected drafts are never cached: a second run over the same prompts hits only what the
    first computed, and gives the same output."""
    shared = list(range(100, 124))
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared + [1, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)
    plain, _ = _run(prompts, params)
    references = _references(prompts, plain)
    llm = _llm(speculative_config=NGRAM)
    llm.engine.spec.proposer = OracleProposer(references, 3)
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.block_manager.prefix_hits_tokens > 0
    _assert_same(plain, first)
    _assert_same(plain, second)
    llm.shutdown()


@pytest.mark.parametrize("on_device", [False, True], ids=["host-drafts", "device-drafts"])
def test_stops_cut_the_accepted_run(on_device):
    """A stop token id, a stop string and max_tokens that fall inside an accepted run end the output where the plain
    run ends it (with device drafts, in a step the next was launched behind)."""
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(PROMPTS[:3], base)
    refs = _references(PROMPTS[:3], plain)
    stop_token = refs[0][1][9]
    tokenizer = _llm().get_tokenizer()
    stop_string = tokenizer.decode(refs[1][1][12:14])
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_string]),
              SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)]
    plain, _ = _run(PROMPTS[:3], params)
    assert plain[0].outputs[0].finish_reason == plain[1].outputs[0].finish_reason == "stop"
    spec, engine = _run(PROMPTS[:3], params, 4, refs, on_device, speculative_config=NGRAM)
    _assert_same(plain, spec)
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0 and (engine.spec.num_steps_ahead > 0) == on_device


def test_ngram_speculation_on_the_tiny_model_changes_nothing():
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1, ignore_eos=True)
    plain, _ = _run(PROMPTS, params)
    spec, engine = _run(PROMPTS, params, speculative_config=NGRAM)
    _assert_same(plain, spec)
    assert engine.scheduler.spec_stats.num_draft_tokens > 0


ALLOWED = [3, 17, 40, 41, 99, 123, 300, 311]


class FixedDrafts:
    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, token_ids):
        return list(self.drafts)


def test_sampled_distributions_are_the_plain_ones():
    """Thousands of seeded requests over an 8-token vocabulary (allowed_token_ids) with logit_bias, temperature,
    top-k, top-p, min-p and penalties: each position's token distribution, and the joint of the first two, are the
    same with drafts proposed as without (chi-square on the contingency tables)."""
    num = 2000
    bias = {3: 1.5, 17: 1.0, 40: 0.5, 300: -1.0}
    params = [SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02, repetition_penalty=1.5,
                             presence_penalty=1.0, frequency_penalty=0.5, logit_bias=bias, allowed_token_ids=ALLOWED,
                             max_tokens=3, ignore_eos=True, seed=s) for s in range(num)]
    prompts = [[5, 6, 7, 8]] * num
    kwargs = dict(num_kv_blocks=2048, max_num_seqs=256)
    plain, _ = _run(prompts, params, **kwargs)
    llm = _llm(speculative_config=NGRAM, **kwargs)
    llm.engine.spec.proposer = FixedDrafts([3, 17])
    spec = llm.generate(prompts, params, use_tqdm=False)
    stats_ = llm.engine.scheduler.spec_stats
    assert 0 < stats_.num_accepted_tokens < stats_.num_draft_tokens
    llm.shutdown()
    a, b = _same_distributions(plain, spec, num, 3, pair=0)
    assert not (a == b).all()  # the draws themselves differ: only their distributions agree


def _same_distributions(plain, spec, num: int, length: int, pair: int) -> tuple[np.ndarray, np.ndarray]:
    """Asserts two runs' outputs over ALLOWED have the same token distribution at each position and the same joint
    distribution of positions pair and pair + 1 (chi-square on the contingency tables); returns their tokens."""
    a = np.array([o.outputs[0].token_ids for o in plain])
    b = np.array([o.outputs[0].token_ids for o in spec])
    assert a.shape == b.shape == (num, length)
    index = {t: i for i, t in enumerate(ALLOWED)}
    for j in range(length):
        table = np.array([np.bincount([index[t] for t in x[:, j]], minlength=8) for x in (a, b)])
        table = table[:, table.sum(axis=0) > 0]
        assert stats.chi2_contingency(table).pvalue > 1e-3, (j, table)
    pairs = np.array([np.bincount([index[s] * 8 + index[t] for s, t in x[:, pair:pair + 2]], minlength=64)
                      for x in (a, b)])
    pairs = pairs[:, pairs.sum(axis=0) >= 5]
    assert stats.chi2_contingency(pairs).pvalue > 1e-3
    return a, b


PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass lantern and a "
           "notebook in which he recorded the weather, the ships that passed, and the colour of the sea.")
CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
COPY_PROMPTS = [
    [{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Rename the function area to rect_area and print the whole code:\n\n{CODE}"}],
]


@pytest.mark.parametrize("on_device", [False, True], ids=["host-drafts", "device-drafts"])
def test_smollm2_copy_workload_gives_the_plain_output_with_drafts_accepted(real_llm, real_model_dir, on_device):
    """SmolLM2-135M-Instruct copying a passage and editing code: n-gram drafts are accepted (more than half of them
    here) and the output, tokens and logprobs, is the plain engine's. The drafts come from the driver's lookup
    (steps not overlapped) or from the workers' on the device (steps launched ahead of the verify step in flight)."""
    from pagoda import LLM

    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)
    plain = real_llm.chat(COPY_PROMPTS, params, use_tqdm=False)
    llm = LLM(model=real_model_dir, dtype="float32", device="cpu", num_kv_blocks=256, speculative_config=NGRAM)
    llm.engine.executor.supports_overlap = on_device  # off: every step is read back before the next
    spec = llm.chat(COPY_PROMPTS, params, use_tqdm=False)
    llm.engine.check_integrity()
    stats_ = llm.engine.scheduler.spec_stats
    assert (llm.engine.spec.num_steps_ahead > 0) == on_device
    llm.shutdown()
    _assert_same(plain, spec)
    assert "lighthouse keeper climbed" in spec[0].outputs[0].text and "rect_area" in spec[1].outputs[0].text
    print(f"acceptance {stats_.acceptance_rate:.2f} ({stats_.num_accepted_tokens}/{stats_.num_draft_tokens}), "
          f"{1 + stats_.num_accepted_tokens / stats_.num_drafts:.2f} tokens a speculative step, "
          f"by position {stats_.accepted_per_position}")
    assert stats_.acceptance_rate > 0.3


def test_engine_stats_and_metrics_count_drafts_with_vllms_names():
    from cluster.metrics import ReplicaMetrics

    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _ = _run(PROMPTS[:2], params)
    llm = _llm(speculative_config=NGRAM)
    llm.engine.spec.proposer = OracleProposer(_references(PROMPTS[:2], plain), 4)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    stats_ = llm.engine.get_stats()
    llm.shutdown()
    spec = llm.engine.scheduler.spec_stats
    assert stats_.spec_decode_num_draft_tokens == spec.num_draft_tokens > stats_.spec_decode_num_accepted_tokens > 0
    assert sum(stats_.spec_decode_num_accepted_tokens_per_pos) == stats_.spec_decode_num_accepted_tokens
    assert stats_.generation_tokens == 60
    metrics = ReplicaMetrics("m", "r", use_ray=False)
    metrics.sync_engine_stats(stats_)
    samples = {(s[0], s[1].get("position")): s[2] for f in metrics.snapshot() for s in f.samples}
    assert samples[("pagoda:spec_decode_num_draft_tokens_total", None)] == stats_.spec_decode_num_draft_tokens
    assert samples[("pagoda:spec_decode_num_accepted_tokens_total", None)] == stats_.spec_decode_num_accepted_tokens
    assert samples[("pagoda:spec_decode_num_drafts_total", None)] == stats_.spec_decode_num_drafts
    assert samples[("pagoda:spec_decode_num_accepted_tokens_per_pos_total", "0")] == \
        stats_.spec_decode_num_accepted_tokens_per_pos[0]


def constrained_case() -> tuple[list[list[int]], list[SamplingParams]]:
    """(prompts, params): a plain greedy request, a greedy one under [a-z]{3,12} (with logprobs) and a seeded
    sampled one under it."""
    from engine.structured_outputs import StructuredOutputsParams

    regex = StructuredOutputsParams(regex="[a-z]{3,12}")
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=regex, logprobs=2),
              SamplingParams(temperature=1.0, seed=7, max_tokens=30, structured_outputs=regex)]
    return [PROMPTS[0], PROMPTS[1], PROMPTS[1]], params


def test_constrained_requests_speculate_within_their_grammar():
    """A request with a grammar speculates: its drafts are cut to what the grammar accepts and each position is
    sampled under the grammar's mask after the drafts before it; greedy output is the plain output, a sampled one
    stays in the grammar. Drafts the grammar rejects (digits for [a-z]) are never scored."""
    prompts, params = constrained_case()
    plain, _ = _run(prompts, params)
    assert plain[1].outputs[0].text.isalpha() and len(plain[1].outputs[0].token_ids) > 2
    references = _references(prompts, plain)[1:2]  # the oracle proposes for the constrained greedy request only
    spec, engine = _run(prompts, params, 4, references, speculative_config=NGRAM)
    _assert_same(plain[:2], spec[:2])
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0  # the constrained request's drafts
    assert spec[2].outputs[0].text.isalpha() and spec[2].outputs[0].finish_reason == "stop"

    tokenizer = _llm().get_tokenizer()
    digits = [t for t in tokenizer.encode("1 2 3 4 5 6 7 8 9", add_special_tokens=False)
              if not tokenizer.decode([t]).strip().isalpha()][:4]
    llm = _llm(speculative_config=NGRAM)
    llm.engine.spec.proposer = FixedDrafts(digits)
    outs = llm.generate(prompts[1:2], params[1:2], use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.scheduler.spec_stats.num_draft_tokens == 0
    _assert_same(plain[1:2], outs)
    llm.shutdown()


def test_grammar_keeps_its_state_through_proposals_and_masks_each_draft_position():
    """RequestGrammar.valid_prefix leaves the matcher where it was; fill_bitmask gives a speculating request one row
    per position, each the mask after that many of its drafts."""
    import numpy as np

    from engine.structured_outputs import StructuredOutputsParams

    llm = _llm(speculative_config=NGRAM)
    tokenizer = llm.get_tokenizer()
    letters = tokenizer.encode("abc", add_special_tokens=False)
    engine = llm.engine
    engine.add_request("g", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="abc[0-9]")), stream=False)
    req = engine.scheduler.requests["g"]
    engine.structured.wait_for_compile(timeout_s=30)
    while not req.grammar.is_ready:
        engine.structured.poll()
    assert req.grammar.valid_prefix(letters + letters) == letters  # "abcabc": the second "a" is refused
    assert req.grammar.valid_prefix(letters) == letters  # the matcher was rolled back
    mask = engine.structured.fill_bitmask(["g"], engine.scheduler.requests, {"g": letters})
    assert mask.req_ids == ["g"] * (1 + len(letters))
    allowed = [{t for t in range(engine.vocab_size) if mask.bitmask[j, t // 32] >> (t % 32) & 1}
               for j in range(1 + len(letters))]
    for j, token in enumerate(letters):
        assert token in allowed[j] and all(token not in allowed[i] for i in range(j))
    assert all(tokenizer.decode([t]).strip().isdigit() for t in allowed[-1] if tokenizer.decode([t]).strip())
    first_row = mask.bitmask[0].copy()  # (the manager reuses its array)
    assert np.array_equal(engine.structured.fill_bitmask(["g"], engine.scheduler.requests).bitmask[0], first_row)
    engine.abort_request(["g"])
    llm.shutdown()


def test_greedy_with_every_knob_over_the_accepted_history():
    """Greedy rows whose argmax depends on the history (repetition, frequency and presence penalties over the
    accepted drafts before each position), logit_bias, min_tokens with a stop token, n = 2, prompt logprobs: the
    plain output."""
    plain_params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=3, prompt_logprobs=1, n=2,
                                  repetition_penalty=1.2, frequency_penalty=1.0, presence_penalty=0.3,
                                  logit_bias={7: 8.0, 8: 7.5, 9: -3.0}, min_tokens=12)
    plain, _ = _run(PROMPTS[:3], plain_params)
    stop_token = plain[0].outputs[0].token_ids[5]  # inside min_tokens: it must not stop there
    params = SamplingParams(**{**{f: getattr(plain_params, f) for f in ("temperature", "max_tokens", "logprobs",
                                                                          "prompt_logprobs", "n",
                                                                          "repetition_penalty", "frequency_penalty",
                                                                          "presence_penalty", "logit_bias",
                                                                          "min_tokens")},
                               "stop_token_ids": [stop_token]})
    plain, _ = _run(PROMPTS[:3], params)
    favoured = sum(o.outputs[0].token_ids.count(7) + o.outputs[0].token_ids.count(8) for o in plain)
    assert favoured > 8  # favoured, then penalized: the history decides when they come back
    spec, engine = _run(PROMPTS[:3], params, 4, _references(PROMPTS[:3], plain), speculative_config=NGRAM)
    _assert_same(plain, spec)
    for a, b in zip(plain, spec):
        assert a.prompt_logprobs == b.prompt_logprobs
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0


# ---- when speculation pays -------------------------------------------------------------------------------------------
def test_step_cost_model_fits_the_fixed_and_per_token_cost():
    from engine.spec_decode import StepCostModel

    cost = StepCostModel()
    assert cost.ratio(64, 320) is None  # no samples
    for n in [1, 1, 4, 16, 64, 64, 256, 2048, 2048, 512]:
        cost.record(n, 0.004 + 0.00002 * n)
    assert cost.ratio(64, 320) is None  # fitted again only every REFIT_EVERY samples
    for _ in range(cost.REFIT_EVERY - 10):
        cost.record(8, 0.004 + 0.00002 * 8)
    assert cost.ratio(64, 320) == pytest.approx((0.004 + 320 * 0.00002) / (0.004 + 64 * 0.00002))
    for _ in range(cost.REFIT_EVERY - 1):
        cost.record(8, 1.0)  # (a step that took long: the fit stands until REFIT_EVERY samples are in)
    assert cost.ratio(64, 320) == pytest.approx((0.004 + 320 * 0.00002) / (0.004 + 64 * 0.00002))
    cost.record(8, 1.0)
    assert cost.ratio(64, 320) != pytest.approx((0.004 + 320 * 0.00002) / (0.004 + 64 * 0.00002))
    cost.clear()
    assert cost.ratio(64, 320) is None and not cost.samples
    one_size = StepCostModel()
    for _ in range(20):
        one_size.record(8, 0.005)
    assert one_size.ratio(8, 40) is None  # one step size: the per-token term is not known


def test_a_verify_step_is_not_priced_past_the_steps_measured():
    """Plain decode steps alone (speculation off, no prefill left in the window) of a host-bound model, where one
    more request costs 30 us of host time over a 0.25 ms step, and a few probes. Extrapolated to a verify step's 5x
    tokens, that line priced it at 4.0 plain steps, over the 3.7 tokens acceptance 0.85 gives, and speculation
    stayed off for good. Past EXTRAPOLATE times the largest step measured the model prices nothing (the engine
    speculates), and the verify steps' own times decide: cheap ones keep it on, dear ones turn it off."""
    from engine.spec_decode import SpecDecoder

    def plain_steps(spec):
        for r in list(range(32, 0, -1)) * 2:
            spec.cost.record(r, 0.00025 + 0.00003 * r)
        for _ in range(4):  # probes: 4 of 32 requests with drafts, the step not overlapped
            spec.cost.record(48, 0.00025 + 0.00003 * 32 + 0.0003)

    for verify_s, pays in [(0.0017, True), (0.006, False)]:
        spec = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3))
        spec.observe(100, 85)
        plain_steps(spec)
        assert spec.cost.ratio(32, 96) is not None and spec.cost.ratio(32, 160) is None
        assert spec.should_speculate(32)
        for _ in range(spec.cost.REFIT_EVERY):
            spec.cost.record(160, verify_s)
        assert spec.cost.ratio(32, 160) is not None and spec.should_speculate(32) is pays


@pytest.mark.parametrize("on_device", [False, True], ids=["host-drafts", "device-drafts"])
def test_steps_with_prompt_chunks_price_no_verify_step(on_device):
    """The cost model takes decode steps only (each request's last token and its drafts). A step with prompt chunks
    runs eagerly: on the H100, SmolLM2's 288-token one took 18 ms against 2.5 for a graphed 160-token verify step,
    and in the fit its slope priced verify steps at 5.2 plain steps, so `auto` ran 95 of 134 steps at batch 32
    without drafts (0.92x of plain; with decode steps only, 1.33x)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (37, 40, 23, 30)]
    plain, _ = _run(PROMPTS, params)
    spec, engine = _run(PROMPTS, params, 4, _references(PROMPTS, plain), on_device, speculative_config=NGRAM)
    samples = [n for n, _ in engine.spec.cost.samples]
    assert sum(len(p) for p in PROMPTS) > len(PROMPTS) * (1 + 4)  # the first step's prefills: more tokens than
    assert samples and max(samples) <= len(PROMPTS) * (1 + 4)  # any decode step of these requests can have
    assert any(n > len(PROMPTS) for n in samples)  # verify steps are in


def test_expected_tokens_of_a_verify_step():
    from engine.spec_decode import expected_tokens

    assert expected_tokens(0.5, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0


def _decoding_request(i: int):
    """What SpecDecoder.propose reads of a decoding request (its last token not yet computed), whose tokens repeat
    (the n-gram lookup finds drafts)."""
    from types import SimpleNamespace

    tokens = [1, 2, 3, 4] * 3
    return SimpleNamespace(req_id=str(i), grammar=None, num_pending_tokens=0, num_computed_tokens=len(tokens) - 1,
                           num_tokens=len(tokens), max_tokens=100, num_output_tokens=0, num_prompt_tokens=len(tokens),
                           prompt_token_ids=tokens, output_token_ids=[], spec_token_ids=[], num_pending_drafts=0,
                           num_known_tokens=len(tokens))


def test_speculation_turns_off_where_the_verify_step_costs_more_than_it_gives():
    """A memory-bound small step and a compute-bound large one: with acceptance 0.6 (2.3 tokens a 5-token verify
    step) speculation pays at batch 1, not at batch 256 (nor at 64); every PROBE_EVERY steps off, a probe step of up
    to PROBE_MAX_BATCH requests gives drafts to PROBE_REQUESTS of them; disable_by_batch_size overrides the model."""
    from engine.spec_decode import SpecDecoder

    spec = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3))
    assert spec.should_speculate(256) and spec.decide(256) == 256  # nothing measured yet
    for n in [1, 8, 64, 256, 1024, 2048, 4096, 1, 16, 512]:
        spec.cost.record(n, 0.004 + 0.00002 * n)
    spec.observe(10, 6)
    assert spec.acceptance == 0.6
    assert spec.should_speculate(1) and not spec.should_speculate(256)
    assert spec.decide(1) == 1
    decisions = [spec.decide(256) for _ in range(3 * spec.PROBE_EVERY)]
    assert decisions == [0] * 3 * spec.PROBE_EVERY  # no probe of a batch past PROBE_MAX_BATCH (an eager verify)
    batch = spec.PROBE_MAX_BATCH
    spec.recent.clear()
    spec.observe(10, 2)  # acceptance 0.2: 1.25 tokens a verify step, which costs 1.97 plain ones at batch 64
    assert not spec.should_speculate(batch) and spec.should_speculate(1)
    # the probe stands until the proposer is asked (a step that drains an overlapped one first asks nothing)
    assert [spec.decide(batch) for _ in range(2)] == [spec.PROBE_REQUESTS] * 2
    assert spec.num_steps_off == 3 * spec.PROBE_EVERY
    running = [_decoding_request(i) for i in range(6)]
    assert spec.propose(running, spec.PROBE_REQUESTS) >= 0
    assert [bool(r.spec_token_ids) or r.req_id for r in running][spec.PROBE_REQUESTS:] == ["4", "5"]  # asked 4
    assert spec.decide(batch) == 0 and spec.decide(0) == 0
    limited = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3, disable_by_batch_size=2))
    assert limited.should_speculate(2) and not limited.should_speculate(3)
    assert [limited.decide(3) for _ in range(3 * limited.PROBE_EVERY)] == [0] * 3 * limited.PROBE_EVERY  # no probes
    with pytest.raises(ParamError) as e:
        SpeculativeConfig("ngram", 4, 1, 3, disable_by_batch_size=0)
    assert e.value.param == "speculative_config.disable_by_batch_size"


def test_the_acceptance_follows_the_last_steps_with_drafts():
    """The ratio over the last ACCEPTANCE_STEPS steps that had draft positions: a preamble whose drafts all failed
    is outweighed by the first probe whose drafts are accepted (a copy that starts late), and old steps leave."""
    from engine.spec_decode import SpecDecoder

    spec = SpecDecoder(SpeculativeConfig("ngram", 3, 1, 3))
    assert spec.acceptance is None
    spec.observe(0, 0)  # no draft positions: nothing learned
    assert spec.acceptance is None
    spec.observe(3, 0)
    assert spec.acceptance == 0.0
    spec.observe(3, 3)
    assert spec.acceptance == 0.5
    for _ in range(spec.ACCEPTANCE_STEPS):
        spec.observe(4, 2)
    assert spec.acceptance == 0.5 and len(spec.recent) == spec.ACCEPTANCE_STEPS


def test_a_copy_after_a_preamble_speculates_once_the_copy_starts():
    """SmolLM2 asked to copy a line answers with a preamble first ("The original line is: ..."): the first step's
    drafts are rejected and speculation turns off; a probe step during the copy finds its drafts accepted and turns
    it on again (it used to stay off for the whole request: a probe's step went to draining the overlapped step
    before it, and one probe in 32 steps moved a decaying average by a tenth). The output is the plain engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    passage = "Copy this line exactly: the cat sat on the mat and the dog lay by the door.\n"
    kwargs = {"model": None, "dtype": "float32", "num_kv_blocks": 64, "block_size": 16}
    plain, _ = _run([passage * 2], params, **kwargs)
    spec, engine = _run([passage * 2], params, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                        **kwargs)
    _assert_same(plain, spec)
    stats = engine.scheduler.spec_stats
    assert engine.spec.num_steps_off > 0 and stats.num_accepted_tokens >= 3, (stats, plain[0].outputs[0].text)


def test_batches_without_drafts_overlap_their_steps_and_give_the_plain_output():
    """disable_by_batch_size 1: while three requests decode there are no drafts and the steps overlap (one in
    flight while the next is scheduled); once one is left it speculates, without overlap: each verify step is read
    back before the next is launched, but step() returns with it in flight, unread (its deltas come once the next
    is launched). Greedy output = plain."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (12, 16, 40)]
    prompts = PROMPTS[:3]
    plain, _ = _run(prompts, params)
    llm = _llm(speculative_config=NGRAM | {"disable_by_batch_size": 1})  # off while 2 or 3 requests run
    llm.engine.spec.proposer = OracleProposer(_references(prompts, plain), 4)
    engine, overlapped, speculated, verify_in_flight = llm.engine, 0, 0, 0
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, sp, stream=False)
    while engine.has_unfinished_requests():
        engine.step()
        pending = engine._pending
        overlapped += pending is not None and pending.overlapped
        speculated += engine._speculating
        if pending is not None and pending.sched.scheduled_spec_token_ids:
            assert not pending.overlapped and pending.handle.payload._output is None  # launched, not read back
            verify_in_flight += 1
        engine.check_integrity()
    assert overlapped > 0 and speculated > 0 and verify_in_flight > 0 and engine.spec.num_steps_off > 0
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    spec_outs = llm.generate(prompts, params, use_tqdm=False)  # the same engine, offline API, end to end
    _assert_same(plain, spec_outs)
    llm.shutdown()


class NoDrafts:
    def propose(self, token_ids):
        return []


def test_a_proposer_that_finds_nothing_turns_speculation_off():
    """Draft positions the proposer finds nothing for count as drafts not accepted: with acceptance 0 a verify step
    can give only its one token, never worth more than a plain step, so once the engine has fitted its step costs
    the steps run without drafts, overlapped (one in PROBE_EVERY asks the proposer again)."""
    llm = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    engine = llm.engine
    engine.spec.proposer = NoDrafts()
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[3]}, params, stream=False)
    overlapped = 0
    while engine.has_unfinished_requests():
        engine.step()
        overlapped += engine._pending is not None and engine._pending.overlapped
    # (acceptance 0.0, not None: no draft was ever scored, the positions found empty count)
    assert engine.spec.acceptance == 0.0 and engine.spec.num_steps_off > 0 and overlapped > 0
    assert engine.scheduler.spec_stats.num_draft_tokens == 0
    llm.shutdown()


# ---- steps launched ahead: device drafts ---------------------------------------------------------------------------
class FixedLookup:
    """In the runner's place of the device n-gram lookup: the same drafts for every row (a CPU test double)."""

    def __init__(self, drafts):
        self.drafts = drafts

    def __call__(self, tokens, lengths, k, min_n, max_n):
        drafts = torch.tensor(self.drafts[:k] + [0] * (k - len(self.drafts[:k])), dtype=torch.long)
        rows = tokens.shape[0]
        return drafts.repeat(rows, 1), torch.full((rows,), min(k, len(self.drafts)), dtype=torch.long)


@pytest.mark.slow  # 13 s; make test keeps the pipelined twin, test_sampled_distributions_are_the_plain_ones
def test_unseeded_sampled_distributions_are_the_plain_ones_with_steps_launched_ahead():
    """Unseeded sampling runs ahead (no knob of it follows the position or the history): thousands of requests over an
    8-token vocabulary with logit_bias, temperature, top-k, top-p and min-p, device drafts rejection-sampled in steps
    launched before the verify step in flight is read back. Each position's distribution and the joint of the first
    two are the plain engine's (chi-square)."""
    num = 2000
    bias = {3: 1.5, 17: 1.0, 40: 0.5, 300: -1.0}
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02, logit_bias=bias,
                            allowed_token_ids=ALLOWED, max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7, 8]] * num
    kwargs = dict(num_kv_blocks=2048, max_num_seqs=256)
    plain, _ = _run(prompts, params, **kwargs)
    llm = _llm(speculative_config=NGRAM, **kwargs)
    llm.engine.executor.worker.runner.lookup = FixedLookup([3, 17])
    spec = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    stats_ = llm.engine.scheduler.spec_stats
    assert 0 < stats_.num_accepted_tokens < stats_.num_draft_tokens and llm.engine.spec.num_steps_ahead > 0
    # the lookup found 2 drafts a row: the counters count those (vLLM's proposed drafts), not the 4 positions
    assert stats_.num_draft_tokens <= 2 * stats_.num_drafts and len(stats_.accepted_per_position) == 2
    llm.shutdown()
    _same_distributions(plain, spec, num, 4, pair=1)


def test_penalized_requests_run_ahead_with_the_plain_output():
    """Penalties at every verified position read the device token histories (the step before's tokens, then the
    drafts before that position: spec_verify.position_penalties), so penalized requests run ahead: greedy with
    repetition, frequency and presence penalties, partly accepted device drafts, the plain engine's tokens and
    logprobs."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.2, presence_penalty=0.1) for n in (37, 40, 23, 30)]
    plain, _ = _run(PROMPTS, params)
    spec, engine = _run(PROMPTS, params, 4, _references(PROMPTS, plain)[:3], True, speculative_config=NGRAM)
    _assert_same(plain, spec)
    stats_ = engine.scheduler.spec_stats
    assert 0 < stats_.num_accepted_tokens < stats_.num_draft_tokens and engine.spec.num_steps_ahead > 10


def test_min_tokens_runs_ahead_with_the_plain_output():
    """A request whose outputs are still short of its min_tokens runs ahead: its count of outputs on the device
    moves back by the drafts the verify step in flight rejected, and its stop token is blocked while that count is
    short (sampler.apply_min_tokens). The stop token comes third in its output without min_tokens, so the drafts
    replayed from that output are rejected from there: steps launched ahead while it is short, partly accepted. A
    third request's stop id comes right at its min_tokens: it stops there, as in the plain engine. Every output is
    the plain engine's."""
    prompts = PROMPTS[:3]
    base = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)
    plain, _ = _run(prompts, base)
    refs = _references(prompts, plain)
    # a stop id its output without min_tokens has third: min_tokens holds it back, and the output goes elsewhere
    stop = refs[1][1][2]
    # and one whose stop id first comes at its position `edge` without min_tokens: min_tokens = edge stops it there,
    # where the count of outputs is decided on the device (the drafts before it are unsure in the steps ahead)
    third = refs[2][1]
    edge = next(m for m in range(6, len(third)) if third[m] not in third[:m])
    params = [base, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=12,
                                   stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=edge,
                             stop_token_ids=[third[edge]])]
    # and some whose stop id first comes one before their min_tokens: held back there only while the count on the
    # device is short, which a step ahead of a verify step that rejected drafts counts as met on the host
    lates = [m for m in range(6, len(third)) if third[m - 1] not in third[:m - 1]]
    prompts = prompts + [prompts[2]] * len(lates)
    params += [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=m,
                              stop_token_ids=[third[m - 1]]) for m in lates]
    plain, _ = _run(prompts, params)
    assert list(plain[2].outputs[0].token_ids) == third[:edge + 1] and lates
    llm = _llm(speculative_config=NGRAM)
    llm.engine.executor.worker.runner.lookup = OracleLookup(refs, 4)
    engine, outputs, ahead_short, ahead = llm.engine, {}, 0, 0
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, sp, stream=False)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = list(delta.seqs[0].token_ids)
        pending, short = engine._pending, engine.scheduler.requests.get("1")
        if pending is not None and pending.overlapped and pending.sched.scheduled_spec_token_ids:
            ahead += 1  # (decided before this step read anything back: its outputs then were no more than now)
            ahead_short += short is not None and short.num_output_tokens < 12
        engine.check_integrity()
    assert ahead_short > 0 and ahead > ahead_short
    stats_ = engine.scheduler.spec_stats
    assert 0 < stats_.num_accepted_tokens < stats_.num_draft_tokens
    assert [outputs[str(i)] for i in range(len(prompts))] == [list(o.outputs[0].token_ids) for o in plain]
    assert stop not in plain[1].outputs[0].token_ids[:12] and len(plain[1].outputs[0].token_ids) > 12
    llm.shutdown()


def test_plain_steps_follow_a_verify_step_in_flight():
    """disable_by_batch_size 1 with device drafts: one request speculates, launching each verify step behind the
    one in flight; two more join mid-way, and the steps without drafts that follow are launched behind the last
    verify step before it is read (their positions moved back on the device); once one request is left it
    speculates again. Every output is the plain engine's."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (40, 12, 16)]
    prompts = PROMPTS[:3]
    plain, _ = _run(prompts, params)
    llm = _llm(speculative_config=NGRAM | {"disable_by_batch_size": 1})
    llm.engine.executor.worker.runner.lookup = OracleLookup(_references(prompts, plain), 4)
    engine, texts, plain_after_verify = llm.engine, {}, 0
    engine.add_request("0", {"prompt_token_ids": prompts[0]}, params[0], stream=False)
    steps = 0
    while engine.has_unfinished_requests():
        before = engine._pending
        for delta in engine.step():
            if delta.finished:
                texts[delta.request_id] = delta.seqs[0].token_ids
        steps += 1
        if steps == 6:
            for i in (1, 2):
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i], stream=False)
        now = engine._pending
        if (before is not None and before.sched.scheduled_spec_token_ids and now is not None and now.overlapped
                and not now.sched.scheduled_spec_token_ids):
            plain_after_verify += 1
        engine.check_integrity()
    assert plain_after_verify > 0 and engine.spec.num_steps_ahead > 0
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert [list(texts[str(i)]) for i in range(3)] == [list(o.outputs[0].token_ids) for o in plain]
    llm.shutdown()


def test_seeded_requests_run_ahead_with_the_tokens_of_pipelined_steps():
    """Seeded sampling runs ahead: a seeded row's noise keys follow its positions, and in a step launched behind a
    verify step they move back on the device with the positions (sampler.shift_keys), in verify steps and in plain
    steps alike (disable_by_batch_size 2: four more requests join mid-way, and the steps without drafts that follow
    were launched behind verify steps), some with penalties (from the device histories at every position). The
    same drafts proposed on the driver (pipelined steps) and on the device (steps launched ahead) give the same
    tokens; the drafts are partly accepted, so positions do move back. Up to the last few: there a step launched
    ahead has room for fewer drafts (its room counts the drafts in flight as accepted), so its draws differ from
    then on."""
    params = [SamplingParams(temperature=0.9, top_k=6, logit_bias={3: 1.5, 17: 1.0}, allowed_token_ids=ALLOWED,
                             max_tokens=40, ignore_eos=True, seed=s, repetition_penalty=1.2 if s % 2 else 1.0,
                             frequency_penalty=0.3 * (s % 3 == 0)) for s in range(6)]
    prompts = [[5, 6, 7, 8], [9, 10, 11]] * 3
    runs = []
    for on_device in (False, True):
        llm = _llm(speculative_config=NGRAM | {"disable_by_batch_size": 2}, num_kv_blocks=512)
        engine = llm.engine
        if on_device:
            engine.executor.worker.runner.lookup = FixedLookup([3, 17])
        else:
            engine.spec.proposer = FixedDrafts([3, 17])
        outputs, steps = {}, 0
        for i in range(2):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i], stream=False)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.finished:
                    outputs[delta.request_id] = list(delta.seqs[0].token_ids)
            steps += 1
            if steps == 6:
                for i in range(2, 6):
                    engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i], stream=False)
            engine.check_integrity()
        runs.append([outputs[str(i)][:40 - 6] for i in range(6)])
        stats_ = engine.scheduler.spec_stats
        assert 0 < stats_.num_accepted_tokens < stats_.num_draft_tokens and engine.spec.num_steps_off > 0
        assert (engine.spec.num_steps_ahead > 0) == on_device
        llm.shutdown()
    assert runs[0] == runs[1]


def _letters_and_a_digit(tokenizer) -> tuple[list[int], int]:
    """Two tokens that are each one lowercase letter, and one that is a digit."""
    words = [(t, tokenizer.decode([t])) for t in range(tokenizer.vocab_size)]
    letters = [t for t, w in words if len(w) == 1 and w.islower()]
    return letters[:2], next(t for t, w in words if w.isdigit())


@pytest.mark.parametrize("drafts_of", [lambda ab, d: ab + [d], lambda ab, d: ab[:1] + [d] + ab[1:]],
                         ids=["digit-last", "digit-second"])
def test_constrained_requests_run_ahead_with_the_tokens_of_pipelined_steps(drafts_of):
    """Grammars run ahead: a step launched behind a verify step defers its sampling until the driver has read that
    step back and advanced the grammars; the workers send the drafts they proposed (Executor.awaiting), and the
    bitmask has a row for each position the grammar reaches through them, where the draft it rejects (a digit under
    [a-z]) is rejected by its mask. The same drafts proposed on the driver (cut there by valid_prefix, pipelined)
    and on the device give the same tokens: seeded sampled and greedy constrained rows (logprobs too), beside an
    unconstrained seeded one. Up to the last few tokens (a step launched ahead has room for fewer drafts there)."""
    from engine.structured_outputs import StructuredOutputsParams

    regex = StructuredOutputsParams(regex="[a-z]{3,80}")
    llm = _llm()
    letters, digit = _letters_and_a_digit(llm.get_tokenizer())
    llm.shutdown()
    drafts = drafts_of(letters, digit)
    bias = {letters[0]: 2.5, letters[1]: 2.0, digit: 4.0}
    params = [SamplingParams(temperature=0.9, max_tokens=30, seed=s, logit_bias=bias, structured_outputs=regex)
              for s in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, logit_bias=bias, structured_outputs=regex),
               SamplingParams(temperature=0.9, max_tokens=30, seed=9, logit_bias=bias, ignore_eos=True)]
    prompts = [PROMPTS[i % 3] for i in range(len(params))]
    runs = []
    for on_device in (False, True):
        llm = _llm(speculative_config=NGRAM, num_kv_blocks=512)
        engine = llm.engine
        if on_device:
            engine.executor.worker.runner.lookup = FixedLookup(drafts)
        else:
            engine.spec.proposer = FixedDrafts(drafts)
        outputs, constrained_ahead = {}, 0
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, sp, stream=False)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.finished:
                    assert delta.error is None, delta.error
                    outputs[delta.request_id] = delta.seqs[0]
            pending = engine._pending
            if pending is not None and pending.overlapped and pending.sched.scheduled_spec_token_ids:
                constrained_ahead += any(engine.scheduler.requests[r].grammar is not None
                                         for r in pending.sched.scheduled_spec_token_ids
                                         if r in engine.scheduler.requests)
            engine.check_integrity()
        for i in range(4):
            text = outputs[str(i)].text
            assert text.isalpha() and text.islower() and len(text) >= 3, text
        runs.append([list(outputs[str(i)].token_ids[:24]) for i in range(len(params))]
                    + [[(lp.token_id, round(lp.logprob, 4), [t for t, _, _ in lp.top])
                        for lp in outputs["3"].logprobs[:24]]])
        stats_ = engine.scheduler.spec_stats
        assert 0 < stats_.num_accepted_tokens < stats_.num_draft_tokens
        assert (constrained_ahead > 5) == on_device
        llm.shutdown()
    assert runs[0] == runs[1]


def test_steps_run_ahead_can_be_turned_off(monkeypatch):
    """PAGODA_SPEC_RUN_AHEAD=0: the n-gram engine proposes on the driver and reads each verify step back before the
    next (the pipelined steps); the same output, no step launched ahead."""
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1, ignore_eos=True)
    ahead, engine = _run(PROMPTS, params, speculative_config=NGRAM)
    assert engine.spec.num_steps_ahead > 0
    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "0")
    pipelined, engine = _run(PROMPTS, params, speculative_config=NGRAM)
    assert engine.spec.num_steps_ahead == 0 and engine.scheduler.spec_stats.num_draft_tokens > 0
    llm = _llm(speculative_config=NGRAM)  # nor does its runner keep histories for a lookup
    assert llm.engine.executor.worker.runner.ngram is None and llm.engine.executor.worker.runner.history.in_use is False
    llm.shutdown()
    _assert_same(ahead, pipelined)


def _drive(choice, periods: dict[bool, float], steps: int) -> list[bool]:
    """Each verify step read back in the way the choice asks, with that way's given period: the ways taken."""
    ways = []
    for _ in range(steps):
        ways.append(choice.ahead)
        choice.record(choice.ahead, periods[choice.ahead])
    return ways


@pytest.mark.parametrize("faster", [True, False], ids=["ahead-faster", "pipelined-faster"])
def test_run_ahead_choice_takes_the_faster_way_and_probes_the_other(faster):
    """The measured choice (RunAheadChoice): ahead first, a trial of the pipelined steps, then the faster way for
    PROBE_EVERY steps between trials of the other; a step launched before a switch is not counted."""
    from engine.spec_decode import RunAheadChoice

    choice = RunAheadChoice()
    periods = {faster: 1.0, not faster: 2.5}  # (verify steps: a host-bound small model, against the device)
    ways = _drive(choice, periods, 400)
    first_trials = 2 * (RunAheadChoice.TRIAL_STEPS + 1)
    assert ways[0] is True and ways[RunAheadChoice.TRIAL_STEPS + 1] is False  # both measured first
    settled = ways[first_trials:]
    share = sum(w == faster for w in settled) / len(settled)
    assert 0.85 < share < 1.0  # mostly the faster, with trials of the other
    assert choice.period[faster] == pytest.approx(1.0) and choice.period[not faster] == pytest.approx(2.5)
    # when the costs cross (the batch grew: the device's step now hides the host's), the choice follows
    periods = {faster: 3.0, not faster: 1.0}
    ways = _drive(choice, periods, 200)
    assert sum(w == (not faster) for w in ways[-100:]) > 85
    before = choice.num_switches
    choice.record(not choice.ahead, 100.0)  # a step of the other way, launched before the switch: not counted
    assert choice.num_switches == before and choice.period[not choice.ahead] != 100.0


def test_run_ahead_choice_backs_off_trials_that_keep_losing():
    """Each trial that finds the other way slower again doubles the steps to the next (up to PROBE_EVERY_MAX): the
    trials' excess shrinks to a small share of a long run; a trial that wins, or costs that cross, bring trials
    back to every PROBE_EVERY steps."""
    from engine.spec_decode import RunAheadChoice

    choice = RunAheadChoice()
    ways = _drive(choice, {True: 2.0, False: 1.0}, 4000)  # pipelined the cheaper: ahead's trials lose
    trial_starts = [i for i in range(1, len(ways)) if ways[i] and not ways[i - 1]]
    gaps = [b - a for a, b in zip(trial_starts, trial_starts[1:])]
    assert len(gaps) >= 4 and all(b >= a for a, b in zip(gaps, gaps[1:])) and gaps[-1] > 4 * gaps[0]  # spread out
    assert choice.probe_every == RunAheadChoice.PROBE_EVERY_MAX
    assert sum(ways[2 * RunAheadChoice.PROBE_EVERY:]) / len(ways[2 * RunAheadChoice.PROBE_EVERY:]) < 0.03
    # ahead turns the cheaper (the batch grew): pipelined's own steps go dear, the choice follows and trials start
    # over from every PROBE_EVERY steps (in 200 steps: one trial of pipelined at most, which loses)
    ways = _drive(choice, {True: 1.0, False: 3.0}, 200)
    assert sum(ways[-100:]) > 90 and choice.probe_every <= 2 * RunAheadChoice.PROBE_EVERY
    # a trial that wins keeps the new way, and the interval starts over (one losing trial of the old way since)
    choice = RunAheadChoice()
    _drive(choice, {True: 2.0, False: 1.0}, 1000)
    assert choice.probe_every > RunAheadChoice.PROBE_EVERY and not choice.ahead
    ways = _drive(choice, {True: 0.5, False: 1.0}, RunAheadChoice.PROBE_EVERY_MAX + 200)
    assert ways[-1] is True and sum(ways[-150:]) > 140 and choice.probe_every <= 2 * RunAheadChoice.PROBE_EVERY


@pytest.mark.parametrize("value, pinned", [("1", True), ("0", False), ("auto", None), ("bogus", None), (None, False),
                                           ("device", False)])
def test_run_ahead_choice_from_the_environment(monkeypatch, value, pinned):
    """Unset or `device` (tests/conftest.py sets 1 for the others) with no measured decode step (a CPU, no CUDA
    graphs), verify steps are pipelined: on an H200 SmolLM2's copy workload ran faster so than under auto or always
    ahead (README, Speculative decoding)."""
    from engine.spec_decode import RunAheadChoice

    if value is None:
        monkeypatch.delenv("PAGODA_SPEC_RUN_AHEAD", raising=False)
    else:
        monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", value)
    choice = RunAheadChoice.from_env()
    assert choice.pinned is pinned and choice.ahead is (pinned is not False)
    _drive(choice, {True: 9.0, False: 1.0}, 50)  # pinned: nothing measured moves it
    assert choice.ahead is (pinned is not False) if pinned is not None else choice.ahead is False


@pytest.mark.parametrize("value", [None, "device"])
def test_run_ahead_by_the_device_step(monkeypatch, value):
    """The default: verify steps run ahead when the device's batch-1 decode step (timed at start-up) is at least
    RUN_AHEAD_MIN_DEVICE_STEP_S (a device-bound model), pipelined below it (host-bound), pinned either way; the
    workers keep the lookup's histories whatever the device (they cannot know the engine's choice), not under 0."""
    from engine.spec_decode import RUN_AHEAD_MIN_DEVICE_STEP_S, RunAheadChoice, may_run_ahead

    if value is None:
        monkeypatch.delenv("PAGODA_SPEC_RUN_AHEAD", raising=False)
    else:
        monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", value)
    assert may_run_ahead()
    for step_s, ahead in [(4.3e-3, True), (RUN_AHEAD_MIN_DEVICE_STEP_S, True), (0.4e-3, False), (None, False)]:
        choice = RunAheadChoice.from_env(step_s)
        assert choice.pinned is ahead and choice.ahead is ahead, step_s
        _drive(choice, {True: 9.0, False: 1.0} if ahead else {True: 1.0, False: 9.0}, 50)
        assert choice.ahead is ahead and choice.num_switches == 0
    # the engine's: the executor's measurement (rank 0's graph replay), through the speculative decoder
    from types import SimpleNamespace

    from engine.spec_decode import SpecDecoder

    for step_s, ahead in [(4.3e-3, True), (0.4e-3, False), (None, False)]:
        spec = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3), SimpleNamespace(decode_step_s=step_s))
        assert spec.can_run_ahead is ahead and spec.drafts_on_device is ahead
    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "0")
    assert not may_run_ahead() and RunAheadChoice.from_env(4.3e-3).pinned is False


def test_engine_times_verify_steps_each_way_and_follows_the_choice(monkeypatch):
    """PAGODA_SPEC_RUN_AHEAD=auto: the engine records each verify step's period (in the way it was launched) and
    launches ahead only while the choice says so; the output is the plain engine's either way."""
    from engine.spec_decode import RunAheadChoice

    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "auto")
    monkeypatch.setattr(RunAheadChoice, "TRIAL_STEPS", 3)
    monkeypatch.setattr(RunAheadChoice, "PROBE_EVERY", 6)
    recorded = []
    record = RunAheadChoice.record
    monkeypatch.setattr(RunAheadChoice, "record", lambda self, ahead, period: (recorded.append(ahead),
                                                                               record(self, ahead, period)))
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)  # (about 25 verify steps)
    plain, _ = _run(PROMPTS, params)
    outs, engine = _run(PROMPTS, params, 4, _references(PROMPTS, plain), True, speculative_config=NGRAM)
    assert engine.spec.run_ahead.pinned is None and engine.spec.run_ahead.num_switches >= 2
    assert True in recorded and False in recorded  # both ways ran and were timed
    assert 0 < engine.spec.num_steps_ahead
    _assert_same(plain, outs)


def test_drafts_priced_out_ahead_turn_on_pipelined(monkeypatch):
    """PAGODA_SPEC_RUN_AHEAD=auto, and drafts that the cost model turns off while verify steps run ahead (a host-bound
    model: SmolLM2 on the H200, whose ahead verify steps cost more than they gave). Periods are timed between
    consecutive verify steps only, so with drafts off (probes alone) the choice could never try the pipelined way and
    speculation stayed off; now it does (RunAheadChoice.drafts_off), and the step costs of the old way are dropped.
    Unless the pipelined way was measured the slower, or nothing was accepted (no way pays then)."""
    from engine.spec_decode import SpecDecoder

    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "auto")
    spec = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3))
    assert spec.run_ahead.ahead and spec.drafts_on_device
    spec.observe(10, 9)

    def priced_out():  # ahead, a verify step of 5 tokens a request costs 4.5 plain steps (acceptance 0.9 gives 4.1)
        spec.cost.clear()
        for _ in range(5):
            spec.cost.record(32, 0.001)
            spec.cost.record(160, 0.0045)
        assert not spec.should_speculate(32)

    priced_out()
    assert spec.decide(32) == 32  # pipelined now, with drafts: the costs are measured again
    assert spec.run_ahead.ahead is False and not spec.cost.samples and spec.num_steps_off == 0
    spec.run_ahead.ahead, spec.run_ahead.period = True, {True: 1.0, False: 2.0}  # pipelined measured the slower
    priced_out()
    assert spec.decide(32) == 0 and spec.run_ahead.ahead and spec.num_steps_off == 1
    spec.run_ahead.period = {True: None, False: None}
    spec.recent.clear()
    spec.observe(10, 0)  # nothing accepted: drafts off either way
    assert spec.decide(32) == 0 and spec.run_ahead.ahead
    limited = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3, disable_by_batch_size=16))  # off by the batch size:
    limited.observe(10, 9)  # the way does not matter
    assert limited.decide(32) == 0 and limited.run_ahead.ahead
    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "1")  # pinned: never switched
    pinned = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3))
    pinned.observe(10, 9)
    spec = pinned
    priced_out()
    assert pinned.decide(32) == 0 and pinned.run_ahead.ahead


def test_engine_speculates_pipelined_where_ahead_verify_steps_do_not_pay(monkeypatch):
    """The engine under auto, its verify steps priced out while launched ahead (emulated: should_speculate says no
    while ahead, yes pipelined, as SmolLM2's costs did on the H200): it speculates pipelined for most steps, not in
    probe steps alone, and gives the plain output."""
    from engine.spec_decode import SpecDecoder

    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "auto")
    monkeypatch.setattr(SpecDecoder, "should_speculate",
                        lambda self, n: not (self.run_ahead.ahead and self.acceptance is not None))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain, _ = _run(PROMPTS, params)
    references = _references(PROMPTS, plain)
    llm = _llm(speculative_config={k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"})
    llm.engine.executor.worker.runner.lookup = OracleLookup(references, 4)
    llm.engine.spec.proposer.propose = OracleProposer(references, 4).propose  # (still the n-gram proposer's type)
    _check_every_step(llm.engine)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.check_integrity()
    llm.shutdown()
    _assert_same(plain, outs)
    spec = llm.engine.spec
    stats = llm.engine.scheduler.spec_stats
    assert spec.run_ahead.num_switches >= 1 and not spec.run_ahead.ahead
    assert stats.num_accepted_tokens > 0.5 * sum(len(c.token_ids) for o in plain for c in o.outputs)
    assert spec.num_steps_off <= 2


def test_probes_back_off_while_their_drafts_give_nothing():
    """Output the proposer never predicts (the 8B preset's random weights): a probe every PROBE_EVERY steps cost its
    steps 8-18% on the H200 (each probe a verify step, pipelined: the step in flight read back first). After
    PROBE_PATIENCE probes in a row that give nothing, each doubles the gap to the next, up to PROBE_EVERY_MAX; an
    accepted draft brings the first gap back."""
    from engine.spec_decode import SpecDecoder

    spec = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3))
    spec.observe(4, 0)  # nothing accepted: drafts off, the first probe after PROBE_EVERY steps
    running = [_decoding_request(0)]
    gaps, since = [], 0
    for _ in range(1000):
        if spec.decide(1):
            assert spec.propose(running, 1) == 0 and running[0].spec_token_ids  # a probe: its drafts, rejected
            spec.observe(4, 0)
            gaps.append(since)
            since = 0
        else:
            since += 1
    assert gaps[:9] == [8, 8, 8, 8, 16, 32, 64, 128, 128] and set(gaps[9:]) == {128}
    spec.observe(4, 1)
    assert spec.probe_every == spec.PROBE_EVERY
