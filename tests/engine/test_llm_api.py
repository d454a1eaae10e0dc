"""The offline LLM and the engines around it, on the built-in tiny model."""

import asyncio
from dataclasses import replace

import pytest

from engine.config import EngineArgs
from pagoda import LLM, SamplingParams
from tests.engines import llm_engine, local_async_engine

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def fibonacci(n):", "Hello"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=256)
    yield llm
    llm.engine.check_integrity()
    llm.shutdown()


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    alone = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=14)
    mixed = llm.generate(PROMPTS + ["Once upon a time"], [others] * 4 + [params], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone
    other_seed = llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                                   max_tokens=10), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone
    llm.engine.check_integrity()


def test_stop_strings_and_stop_token_ids(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20)
    full = llm.generate(["The quick brown fox"], greedy, use_tqdm=False)[0].outputs[0]
    stop_text = full.text[5:8]
    assert stop_text
    cut = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20, stop=[stop_text]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_text
    assert cut.text == full.text[:full.text.index(stop_text)]
    kept = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20, stop=[stop_text],
                                                                include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop_text) + len(stop_text)]
    stop_id = full.token_ids[3]
    by_id = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20,
                                                                 stop_token_ids=[stop_id]), use_tqdm=False)
    out = by_id[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    llm.engine.check_integrity()


def test_n_completions_share_the_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    out = llm.generate(["Once upon a time there was a small model"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per completion
    greedy = llm.generate(["Once upon a time there was a small model"], SamplingParams(n=2, temperature=0,
                                                                                       max_tokens=8),
                          use_tqdm=False)[0]
    single = llm.generate(["Once upon a time there was a small model"], SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == single.outputs[0].token_ids
    llm.engine.check_integrity()


def test_bad_input_raises_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[1] * 5000], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([{"prompt_token_ids": [10**9]}], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], SamplingParams(top_p=2.0), use_tqdm=False)
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.engine.check_integrity()


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (a text prompt keeps its BOS first, as the
    tokenizer's own truncation does); -1: as many as fit beside max_tokens; k past that is a ParamError."""
    tok = llm.get_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog")
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate([ids], SamplingParams(truncate_prompt_tokens=4, **greedy), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:]
    same = llm.generate([ids[-4:]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    text = llm.generate(["The quick brown fox jumps over the lazy dog"],
                        SamplingParams(truncate_prompt_tokens=4, **greedy), use_tqdm=False)[0]
    assert text.prompt_token_ids == [tok.bos_token_id, *ids[-3:]]
    long = [7] * 5000  # past the context: -1 keeps what fits beside max_tokens
    fits = llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)[0]
    assert len(fits.prompt_token_ids) == llm.engine.max_model_len - 5
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=llm.engine.max_model_len, max_tokens=5),
                     use_tqdm=False)
    llm.engine.check_integrity()


def test_allowed_token_ids_are_the_only_tokens_sampled(llm):
    allowed = [300, 301, 302]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed,
                                                ignore_eos=True), use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    mixed = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[42],
                                                      ignore_eos=True),
                                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == [42] * 6 and set(mixed[1].outputs[0].token_ids) != {42}
    llm.engine.check_integrity()


def test_chat_applies_the_template(llm):
    out = llm.chat([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=4, ignore_eos=True),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1


def test_abort_mid_generation_frees_blocks(tiny_model_dir):
    engine = llm_engine(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=64)
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "Hello", SamplingParams(max_tokens=5, ignore_eos=True))
    streamed = []
    for _ in range(3):
        streamed += [d for d in engine.step() if d.request_id == "a"]
    assert engine.block_manager.num_free_blocks < 64
    (last,) = engine.abort_request("a")
    assert last.finished and last.seqs[0].finish_reason == "abort"
    assert sum(d.num_new_tokens for d in streamed + [last]) < 50  # it ended before it could have by itself
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # tells the worker to drop the aborted request
    engine.check_integrity()
    assert not engine.executor.worker.runner.requests
    assert engine.get_stats().num_finished == {"abort": 1, "length": 1}
    engine.shutdown()


async def generate(engine, prompt, params, request_id, stream=True):
    """Every delta of one request, as AsyncLLMEngine yields them (in batches), flattened."""
    _, token_ids = engine.process_prompt(prompt, params)
    return [d async for batch in engine.generate(token_ids, params, request_id, stream) for d in batch]


def test_async_engine_streams_and_aborts_on_cancel(tiny_model_dir):
    async def main():
        engine = local_async_engine(EngineArgs(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=128)
                                .create_engine_config())
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        deltas = await generate(engine, "Hello", params, "r1")
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert sum(d.num_new_tokens for d in deltas) == 6 and len(deltas) > 1  # each step's news, in order
        (final,) = await generate(engine, "Hello", params, "r0", stream=False)
        assert final.finished and final.seqs[0].token_ids == [t for d in deltas for t in d.seqs[0].token_ids]
        assert final.seqs[0].text == "".join(d.seqs[0].text for d in deltas if d.seqs)

        with pytest.raises(ValueError, match="temperature"):
            engine.process_prompt("Hello", SamplingParams(temperature=-1))

        async def consume():
            await generate(engine, "Once upon", SamplingParams(max_tokens=1000, ignore_eos=True), "r2")

        task = asyncio.create_task(consume())
        while engine.get_stats().num_running == 0:
            await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.05)
            if engine.get_stats().num_running == 0:
                break
        await engine.check_integrity()
        stats = engine.get_stats()
        assert stats.kv_cache_usage == 0.0 and stats.num_finished["abort"] == 1
        assert stats.generation_tokens < 6 + 6 + 1000  # r2 ended early
        engine.shutdown()

    asyncio.run(main())


def test_step_timing_and_the_periodic_step_report(tiny_model_dir, monkeypatch, capfd):
    monkeypatch.setenv("PAGODA_LOG_STEPS_S", "0.000001")  # a line after every step
    monkeypatch.setenv("PAGODA_PROFILE_STEPS", "1:2")

    async def main():
        engine = local_async_engine(EngineArgs(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=128)
                                .create_engine_config())
        core_engine = engine.connection.core.engine
        before = replace(core_engine.timing)
        await generate(engine, "Hello", SamplingParams(max_tokens=5, ignore_eos=True), "t")
        timing = core_engine.timing.since(before)
        engine.shutdown()
        return timing

    timing = asyncio.run(main())
    assert timing["steps"] >= 5 and timing["ms_per_step"] > 0
    assert 0 <= timing["device_wait_ms_per_step"] <= timing["ms_per_step"]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("pagoda engine:")]
    assert lines and "ms/step, device wait" in lines[0]
    assert "pagoda engine: profile of steps 1-2" in err and "tottime" in err


def test_stream_interval_deltas_lose_nothing(tiny_model_dir):
    """Deltas at most once per (long) stream interval: the first token and the end come at once, nothing in
    between, and together they are the whole output a request that does not stream gets in its one delta."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = []
    for interval, stream in ((0.0, False), (0.0, True), (60.0, True)):
        engine = llm_engine(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=64,
                                     stream_interval_s=interval)
        engine.add_request("r", "Once upon a time", params, stream=stream)
        got = []
        while engine.has_unfinished_requests():
            got += engine.step()
        outputs.append(got)
        engine.shutdown()
    (whole,), every_step, throttled = outputs
    assert len(every_step) == 12 and len(throttled) == 2  # one per step; first token and end
    first, last = (d.seqs[0] for d in throttled)
    whole = whole.seqs[0]
    assert len(first.token_ids) == 1 and last.finish_reason == "length" and throttled[1].finished
    for deltas in (every_step, throttled):
        seqs = [d.seqs[0] for d in deltas]
        assert [t for s in seqs for t in s.token_ids] == whole.token_ids
        assert "".join(s.text for s in seqs) == whole.text
        assert [e.token_id for s in seqs for e in s.logprobs] == whole.token_ids
        assert [e.top for s in seqs for e in s.logprobs] == [e.top for e in whole.logprobs]
    assert throttled[-1].metrics is not None and throttled[0].metrics is None


def test_malformed_step_report_settings_are_ignored(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PAGODA_LOG_STEPS_S", "often")
    monkeypatch.setenv("PAGODA_PROFILE_STEPS", "a:b")

    async def main():
        engine = local_async_engine(EngineArgs(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=64)
                                .create_engine_config())
        deltas = await generate(engine, "Hi", SamplingParams(max_tokens=3, ignore_eos=True), "m")
        engine.shutdown()
        return deltas

    assert asyncio.run(main())[-1].finished  # the loop runs; the settings only warn
