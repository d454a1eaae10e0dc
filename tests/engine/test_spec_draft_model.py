"""Speculative decoding with a draft model (#34, method "draft_model"): greedy output is the plain engine's, token for
token, whatever the draft proposes; sampled output has the plain engine's distribution, its drafts drawn from the
draft's own. On the tiny model with a second tiny model (another seed, the same vocabulary:
its drafts are nearly all rejected) and with itself (every draft accepted: the draft's own KV catch-up after each
step is right); on SmolLM2-135M with itself (acceptance exactly 1.0). Across batching, chunked prefill, prefix
caching and preemption; a draft forward that raises fails no request; the draft's KV blocks all go back."""

import pytest
import torch

from engine import SamplingParams
from engine.config import EngineArgs
from engine.errors import ParamError
from tests.engine.test_spec_decode import PROMPTS, _assert_same, _llm, _run, constrained_case


def _draft(k: int, model: str = "tiny") -> dict:
    """Every step speculates (disable_by_batch_size above any batch here): the engine's own decision would turn a
    draft that is mostly wrong off, and these tests are about what drafts do."""
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "disable_by_batch_size": 1024}


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """A second tiny Llama: the tiny model's tokenizer and vocabulary, other weights."""
    from checkpoints.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("draft") / "tiny-seed1"), seed=1)


def _settle(llm) -> None:
    """One more step sends the finished requests to the workers; then every draft KV block is free."""
    llm.engine.step()
    llm.engine.check_integrity()
    draft = llm.engine.executor.worker.draft
    assert not draft.states and draft.num_free_blocks == draft.num_blocks


# ---- config ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, kwargs, field", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, {}, "speculative_config.model"),
    ({"method": "ngram", "model": "tiny", "num_speculative_tokens": 3}, {}, "speculative_config.model"),
])
def test_bad_draft_model_configs_are_refused_naming_the_key(bad, kwargs, field):
    with pytest.raises(ParamError) as e:
        EngineArgs(speculative_config=bad, **kwargs)
    assert e.value.param == field


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from checkpoints.tiny import make_tiny_model

    wide = make_tiny_model(str(tmp_path / "wide"), seed=2, config_overrides={"vocab_size": 600})
    with pytest.raises(ParamError, match="vocabulary of 600 tokens") as e:
        EngineArgs(model="tiny", device="cpu", speculative_config=_draft(2, wide)).create_engine_config()
    assert e.value.param == "speculative_config.model"
    with pytest.raises(ParamError) as e:
        EngineArgs(model="tiny", device="cpu", speculative_config=_draft(2, str(tmp_path))).create_engine_config()
    assert e.value.param == "speculative_config.model"  # no checkpoint there


# ---- the engine ------------------------------------------------------------------------------------------------------
FEATURES = [
    {},  # continuous batching: four requests of different lengths in one batch
    {"max_num_batched_tokens": 7},  # chunked prefill; the draft's catch-up passes chunked to the budget too
    {"num_kv_blocks": 26, "enable_prefix_caching": False},  # preemption (the draft's pool of 26 blocks runs out too)
]


@pytest.mark.parametrize("engine_kwargs", FEATURES)
def test_tiny_with_itself_as_draft_accepts_every_draft(engine_kwargs):
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (37, 40, 23, 30)]
    plain, _ = _run(PROMPTS, params, **engine_kwargs)
    llm = _llm(speculative_config=_draft(3), **engine_kwargs)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    _assert_same(plain, spec)
    assert stats.num_draft_tokens > 60 and stats.acceptance_rate == 1.0
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("engine_kwargs", FEATURES)
def test_tiny_with_another_tiny_draft_gives_the_plain_output(other_tiny, engine_kwargs):
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (37, 40, 23, 30)]
    plain, _ = _run(PROMPTS, params, **engine_kwargs)
    llm = _llm(speculative_config=_draft(4, other_tiny), **engine_kwargs)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    _assert_same(plain, spec)
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate < 0.5  # random weights: they disagree


@pytest.mark.parametrize("max_num_seqs", [4, 3], ids=["buckets-1-2-4", "buckets-1-2-3"])
def test_the_drafts_decode_passes_through_its_graph_inputs(max_num_seqs):
    """The draft's passes as its CUDA graphs run them (workers/draft_runner.py; the CPU stand-in of
    tests/cpu_graphs.py replays each graph eagerly over the padded inputs it was captured with): decode passes fed
    their tokens on the device through its decode graphs, catch-ups of the accepted tokens through its verify
    graphs. With itself as draft every draft is still accepted, so each graph-made draft is the target's own next
    token, and the output is the plain engine's; batches that do not fill their bucket included."""
    from tests.cpu_graphs import CpuGraphRunner

    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (37, 40, 23, 30)]
    plain, _ = _run(PROMPTS, params, max_num_seqs=max_num_seqs)
    llm = _llm(speculative_config=_draft(3), max_num_seqs=max_num_seqs)
    draft = llm.engine.executor.worker.draft
    draft.graphs = CpuGraphRunner(draft.model, draft.kv_caches, draft.buffers, max_num_seqs, spec_tokens=3)
    draft.graphs.capture()
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    _assert_same(plain, spec)
    assert draft.graphs.num_replays >= 10  # k - 1 = 2 decode passes a step, about 10 steps (4 tokens each)
    assert draft.graphs.num_verify_replays >= 5  # every catch-up but the prompts' (4 tokens: the drafts and one more)
    assert stats.num_draft_tokens > 60 and stats.acceptance_rate == 1.0


def test_prefix_caching_with_a_draft_model():
    """Requests that share a cached prefix in the target's pool each catch up in the draft's own pool; a second run
    hits the prefix cache and gives the same output, every draft accepted."""
    shared = list(range(100, 124))
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared + [1, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)
    plain, _ = _run(prompts, params)
    llm = _llm(speculative_config=_draft(4))
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    _settle(llm)
    assert llm.engine.block_manager.prefix_hits_tokens > 0
    assert llm.engine.scheduler.spec_stats.acceptance_rate == 1.0
    llm.shutdown()
    _assert_same(plain, first)
    _assert_same(plain, second)


def test_partly_wrong_drafts_are_caught_up_on(monkeypatch):
    """Every other ask's fourth drafts are wrong: that draft is rejected, the ones before it accepted,
    and the next ask's catch-up (the accepted drafts and the target's token) leaves the draft's KV right: its first
    draft is accepted at every step."""
    from workers.draft_runner import DraftRunner

    propose, calls = DraftRunner._propose, [0]

    def sometimes_wrong(self, ask):
        drafts = propose(self, ask)
        calls[0] += 1
        if calls[0] % 2:
            for d in drafts.values():
                if len(d) == 4:
                    d[3] = (d[3] + 1) % 500
        return drafts

    monkeypatch.setattr(DraftRunner, "_propose", sometimes_wrong)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(PROMPTS, params)
    llm = _llm(speculative_config=_draft(4))
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    _assert_same(plain, spec)
    assert calls[0] > 4 and 0.5 < stats.acceptance_rate < 1.0
    assert stats.accepted_per_position[0] == stats.num_drafts  # the first draft: always right


def test_a_failing_draft_fails_no_request(monkeypatch):
    """The draft's forward raises in some asks (the worker drops every draft state) and the executor's call itself
    raises in others: those steps run without drafts, every request ends as in the plain run."""
    from workers.draft_runner import DraftRunner

    forward, calls = DraftRunner._forward, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] % 5 == 0:
            raise RuntimeError("draft forward failed")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DraftRunner, "_forward", failing)
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)
    plain, _ = _run(PROMPTS, params)
    llm = _llm(speculative_config=_draft(3))
    executor, asks = llm.engine.executor, [0]
    propose = executor.propose_drafts

    def sometimes_raising(ask):
        asks[0] += 1
        if asks[0] % 7 == 0:
            from engine.executor import ExecutorError

            raise ExecutorError("the draft's worker did not answer")
        return propose(ask)

    monkeypatch.setattr(executor, "propose_drafts", sometimes_raising)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    _assert_same(plain, spec)
    assert all(o.outputs[0].finish_reason == "length" for o in spec)
    assert calls[0] >= 5 and asks[0] >= 7 and stats.acceptance_rate == 1.0


def test_aborted_and_finished_requests_give_their_draft_blocks_back():
    llm = _llm(speculative_config=_draft(3))
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    for _ in range(6):
        engine.step()
    draft = engine.executor.worker.draft
    assert len(draft.states) == 4 and draft.num_free_blocks < draft.num_blocks
    engine.abort_request(["0", "2"])
    engine.step()
    engine.check_integrity()
    assert set(draft.states) == {"1", "3"}
    while engine.has_unfinished_requests():
        engine.step()
    _settle(llm)
    llm.shutdown()


# ---- SmolLM2-135M ----------------------------------------------------------------------------------------------------
@pytest.mark.slow  # 28 s: make test stays under 15 minutes on 2 cores; CI runs it in test-slow
def test_smollm2_with_itself_as_draft_accepts_every_draft(real_model_dir):
    """SmolLM2-135M-Instruct drafting for itself, four chat requests at once (batching; a shared system prompt: prefix
    caching), prefill in chunks of 64 tokens and a pool small enough to preempt: the plain engine's output with the
    same settings, and acceptance exactly 1.0."""
    from pagoda import LLM
    from tests.engine.test_spec_decode import COPY_PROMPTS

    prompts = COPY_PROMPTS + [[{"role": "user", "content": "Write a short poem about the sea."}],
                              [{"role": "user", "content": "List three prime numbers and explain why."}]]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, ignore_eos=True)
    kwargs = dict(model=real_model_dir, dtype="float32", device="cpu", num_kv_blocks=16,
                  max_num_batched_tokens=64)
    plain_llm = LLM(**kwargs)
    plain = plain_llm.chat(prompts, params, use_tqdm=False)
    plain_llm.shutdown()
    llm = LLM(**kwargs, speculative_config=_draft(4, real_model_dir))
    spec = llm.chat(prompts, params, use_tqdm=False)
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    preemptions, hits = llm.engine.scheduler.num_preemptions, llm.engine.block_manager.prefix_hits_tokens
    llm.shutdown()
    _assert_same(plain, spec, atol=1e-3)
    print(f"acceptance {stats.acceptance_rate} ({stats.num_accepted_tokens}/{stats.num_draft_tokens}), "
          f"{preemptions} preemptions, {hits} prefix-cache tokens")
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate == 1.0
    assert preemptions > 0 and hits > 0


def test_sampled_distributions_with_a_draft_model_are_the_plain_ones():
    """A sampled request's drafts are drawn from the draft's softmax at the request's temperature, q (its top-k and
    logit_bias are the target's alone), and verified with min(1, p / q) and the residual max(p - q, 0). 1500 seeded
    requests (temperature, top-k, logit_bias): each position's token distribution is the plain engine's (chi-square;
    tokens seen fewer than 10 times pooled), some drafts accepted and some rejected."""
    import numpy as np
    from scipy import stats

    num = 1500
    params = [SamplingParams(temperature=0.9, top_k=6, logit_bias={3: 1.5, 17: 1.0}, max_tokens=4, ignore_eos=True,
                             seed=s) for s in range(num)]
    prompts = [[5, 6, 7, 8]] * num
    kwargs = dict(num_kv_blocks=2048, max_num_seqs=256)
    plain, _ = _run(prompts, params, **kwargs)
    spec, engine = _run(prompts, params, speculative_config=_draft(3), **kwargs)
    spec_stats = engine.scheduler.spec_stats
    assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    a = np.array([o.outputs[0].token_ids for o in plain])
    b = np.array([o.outputs[0].token_ids for o in spec])
    for j in range(4):
        tokens = np.unique(np.concatenate([a[:, j], b[:, j]]))
        table = np.array([[(x[:, j] == t).sum() for t in tokens] for x in (a, b)])
        rare = table.sum(axis=0) < 10
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(axis=1, keepdims=True)], axis=1)
        table = table[:, table.sum(axis=0) > 0]
        assert table.shape[1] > 1 and stats.chi2_contingency(table).pvalue > 1e-3, (j, table)


def test_sampled_drafts_from_the_targets_own_distribution_are_accepted():
    """The tiny model drafting for itself at temperature 1: drafts drawn from its own distribution q = p are all but
    always accepted (min(1, p / q) = 1 up to the two paths' rounding), where greedy drafts would be accepted only
    as often as p gives its argmax (far less, over a random model's flat distributions). A seeded request's drafts
    follow its seed: two runs give the same tokens; the draft's q rows are used once and dropped."""
    params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=s) for s in range(4)]
    runs, stats = [], None
    for _ in range(2):
        llm = _llm(speculative_config=_draft(3))
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        _settle(llm)
        assert not llm.engine.executor.worker.draft.probs  # consumed by the last verify step
        stats = llm.engine.scheduler.spec_stats
        llm.shutdown()
    assert runs[0] == runs[1]
    assert stats.num_draft_tokens > 60 and stats.acceptance_rate > 0.9, stats
    greedy_llm = _llm(speculative_config=_draft(3))
    draft = greedy_llm.engine.executor.worker.draft
    prepare = draft._prepare

    def greedy_drafts(*args):  # greedy drafts for sampled requests (one-hot q: what the draft model did before)
        seq = prepare(*args)
        if seq is not None:
            seq.inv_temperature = 0.0
        return seq

    draft._prepare = greedy_drafts
    greedy_llm.generate(PROMPTS, params, use_tqdm=False)
    greedy_stats = greedy_llm.engine.scheduler.spec_stats
    greedy_llm.shutdown()
    assert greedy_stats.num_draft_tokens > 60
    assert greedy_stats.acceptance_rate < stats.acceptance_rate - 0.2, (greedy_stats, stats)


def test_a_full_draft_pool_leaves_requests_without_drafts():
    """A draft pool of 8 blocks (the target's holds 64): the requests it has no room for get no drafts that step
    (their draft state dropped), the others speculate; the plain output, and the books balance."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _ = _run(PROMPTS, params)
    llm = _llm(speculative_config=_draft(3))
    draft = llm.engine.executor.worker.draft
    draft.free_block_ids, draft.num_blocks = draft.free_block_ids[-8:], 8
    asked, answered = [], []
    propose = draft.propose

    def counting(ask):
        drafts = propose(ask)
        asked.append(len(ask.max_drafts))
        answered.append(len(drafts))
        return drafts

    draft.propose = counting
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    _assert_same(plain, spec)
    assert any(a > n for a, n in zip(asked, answered)) and stats.acceptance_rate == 1.0 and stats.num_drafts > 10


def test_an_fp8_kv_target_with_its_draft_in_the_model_dtype():
    """kv_cache_dtype fp8: the target's pool is e4m3, the draft's stays in the model dtype (it has no calibrated
    scales); the target's outputs are the plain fp8 engine's, and the tiny model drafting for itself is now only
    mostly right (its KV is not rounded as the target's)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)
    plain, _ = _run(PROMPTS, params, kv_cache_dtype="fp8")
    llm = _llm(speculative_config=_draft(3), kv_cache_dtype="fp8")
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    draft = llm.engine.executor.worker.draft
    assert draft.kv_caches[0][0].dtype == torch.float32
    _settle(llm)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    _assert_same(plain, spec)
    assert 0.3 < stats.acceptance_rate < 1.0


def test_the_decision_counts_the_proposers_time():
    """Acceptance 0.6 with k = 4 gives 2.3 tokens a verify step, which costs about 1.02 plain steps at batch 1: it
    pays, until the proposer (a draft model's passes) takes about 1.5 plain steps of its own. The proposer's time is
    measured in propose()."""
    from engine.config import SpeculativeConfig
    from engine.spec_decode import SpecDecoder

    spec = SpecDecoder(SpeculativeConfig("ngram", 4, 1, 3))
    for n in [1, 8, 64, 256, 1024, 2048, 4096, 1, 16, 512]:
        spec.cost.record(n, 0.004 + 0.00002 * n)
    spec.observe(10, 6)
    assert spec.should_speculate(1)
    spec.record_propose(0.002)  # half a plain step: 2.3 > 1.52
    assert spec.should_speculate(1)
    for _ in range(60):
        spec.record_propose(0.006)  # 1.5 plain steps: 2.3 < 2.52
    assert spec.propose_s == pytest.approx(0.006, rel=1e-2) and not spec.should_speculate(1)

    class Slow:
        def propose_batch(self, requests, max_drafts):
            import time

            time.sleep(0.05)
            return [[] for _ in requests]

    llm = _llm(speculative_config=_draft(2))
    llm.engine.spec.proposer = Slow()
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.engine.spec.propose_s >= 0.05
    llm.shutdown()


def test_constrained_requests_beside_the_draft_model():
    """A request with a grammar takes the draft model's drafts cut to what its grammar accepts (the draft knows no
    grammar); greedy output is the plain output for it and for an unconstrained request beside it, and a sampled
    constrained one stays in its grammar."""
    prompts, params = constrained_case()
    plain, _ = _run(prompts, params)
    spec, engine = _run(prompts, params, speculative_config=_draft(3))
    _assert_same(plain[:2], spec[:2])
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert spec[2].outputs[0].text.isalpha() and spec[2].outputs[0].finish_reason == "stop"
