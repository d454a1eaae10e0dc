"""The offline LLM and the engines around it, on the built-in tiny model."""

import asyncio
from dataclasses import replace

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.llm_engine import LLMEngine

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
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [10**9]}], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], SamplingParams(top_p=2.0), use_tqdm=False)
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
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
    engine = LLMEngine.from_args(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=64)
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "Hello", SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < 64
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # tells the worker to drop the aborted request
    engine.check_integrity()
    assert not engine.executor.worker.runner.requests
    engine.shutdown()


def test_async_engine_streams_and_aborts_on_cancel(tiny_model_dir):
    async def main():
        engine = AsyncLLMEngine.from_args(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=128)
        seen = []
        async for out in engine.generate("Hello", SamplingParams(max_tokens=6, ignore_eos=True), "r1"):
            seen.append(len(out.outputs[0].token_ids))
        # cumulative outputs, one per step; a consumer that falls behind skips straight to the newest
        assert seen == sorted(set(seen)) and seen[-1] == 6 and out.finished
        final = [out async for out in engine.generate("Hello", SamplingParams(max_tokens=6, ignore_eos=True), "r0",
                                                      final_only=True)]
        assert len(final) == 1 and final[0].finished and len(final[0].outputs[0].token_ids) == 6

        with pytest.raises(ValueError, match="temperature"):
            async for _ in engine.generate("Hello", SamplingParams(temperature=-1), "bad"):
                pass

        async def consume():
            async for _ in engine.generate("Once upon", SamplingParams(max_tokens=1000, ignore_eos=True), "r2"):
                pass

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
        assert engine.get_stats().kv_cache_usage == 0.0
        engine.shutdown()

    asyncio.run(main())


def test_step_timing_and_the_periodic_step_report(tiny_model_dir, monkeypatch, capfd):
    monkeypatch.setenv("PAGODA_LOG_STEPS_S", "0.000001")  # a line after every step
    monkeypatch.setenv("PAGODA_PROFILE_STEPS", "1:2")
    async def main():
        engine = AsyncLLMEngine.from_args(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=128)
        before = replace(engine.engine.timing)
        async for out in engine.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True), "t"):
            pass
        timing = engine.engine.timing.since(before)
        engine.shutdown()
        return timing

    timing = asyncio.run(main())
    assert timing["steps"] >= 5 and timing["ms_per_step"] > 0
    assert 0 <= timing["device_wait_ms_per_step"] <= timing["ms_per_step"]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("pagoda engine:")]
    assert lines and "ms/step, device wait" in lines[0]
    assert "pagoda engine: profile of steps 1-2" in err and "tottime" in err


def test_delta_outputs_with_an_interval_lose_nothing(tiny_model_dir):
    """Delta outputs at most once per (long) interval: the first token and the end come at once, nothing in
    between, and together they are the whole output the engine gives cumulatively."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engines = [LLMEngine.from_args(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=64)
               for _ in range(2)]
    engines[1].delta_outputs, engines[1].output_interval_s = True, 60.0
    outputs = []
    for engine in engines:
        engine.add_request("r", "Once upon a time", params)
        got = []
        while engine.has_unfinished_requests():
            got += engine.step()
        outputs.append(got)
        engine.shutdown()
    cumulative, deltas = outputs
    assert len(cumulative) == 12 and len(deltas) == 2  # one per step; first token and end
    first, last = (d.outputs[0] for d in deltas)
    whole = cumulative[-1].outputs[0]
    assert len(first.token_ids) == 1 and last.finish_reason == "length" and deltas[1].finished
    assert first.token_ids + last.token_ids == whole.token_ids and first.text + last.text == whole.text
    assert [x.keys() for x in first.logprobs + last.logprobs] == [x.keys() for x in whole.logprobs]
    assert abs(last.cumulative_logprob - whole.cumulative_logprob) < 1e-5


def test_malformed_step_report_settings_are_ignored(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PAGODA_LOG_STEPS_S", "often")
    monkeypatch.setenv("PAGODA_PROFILE_STEPS", "a:b")

    async def main():
        engine = AsyncLLMEngine.from_args(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=64)
        outs = [out async for out in engine.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True), "m")]
        engine.shutdown()
        return outs

    assert asyncio.run(main())[-1].finished  # the loop runs; the settings only warn
