"""The engine in its own Ray actor (cluster/engine_core.py): the same outputs as the engine in-process, aborts
that free their blocks (even one that overtakes its add), and a dead engine actor reported as such."""

import asyncio
import time

import pytest

from cluster.engine_core import EngineCore, RemoteAsyncEngine, core_actor_options
from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "The quick brown fox", "def fibonacci(n):"]


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def engine_kwargs(tiny_model_dir):
    return {"model": tiny_model_dir, "device": "cpu", "block_size": 4, "num_kv_blocks": 256,
            "chat_template": CHAT_TEMPLATE}


@pytest.fixture
def remote(ray_cluster, engine_kwargs):
    """A fresh engine actor and its replica-side client; shut down after the test (a warning if it is dead)."""
    engine = RemoteAsyncEngine(engine_kwargs, core_actor_options(engine_kwargs))
    yield engine
    engine.shutdown()


async def _run_all(engine, requests):
    async def one(request_id, prompt, params, final_only=False):
        outs = [out async for out in engine.generate(prompt, params, request_id, final_only=final_only)]
        return outs

    return await asyncio.gather(*(one(*r) for r in requests))


def _requests():
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    pair = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True)
    stop = SamplingParams(temperature=0.0, max_tokens=20, stop=["e"], ignore_eos=True)
    return [("g", PROMPTS[0], greedy), ("n2", PROMPTS[1], pair), ("s", PROMPTS[2], stop),
            ("f", PROMPTS[0], greedy, True)]


def test_remote_engine_gives_the_in_process_outputs(remote, engine_kwargs):
    local = AsyncLLMEngine(LLMEngine.from_args(**engine_kwargs))
    assert remote.tokenizer.chat_template == local.engine.tokenizer.chat_template == CHAT_TEMPLATE  # the override
    try:
        expected = asyncio.run(_run_all(local, _requests()))
        got = asyncio.run(_run_all(remote, _requests()))
        for exp, out in zip(expected, got):
            final_exp, final_out = exp[-1], out[-1]
            assert final_out.finished and final_out.prompt_token_ids == final_exp.prompt_token_ids
            for a, b in zip(final_exp.outputs, final_out.outputs):
                assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
                       (a.text, a.token_ids, a.finish_reason, a.stop_reason)
                if a.logprobs is not None:  # another process, another thread count: float sums may round apart
                    for x, y in zip(a.logprobs, b.logprobs):
                        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
                    assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-3
                else:
                    assert b.logprobs is None
            # cumulative outputs: every one extends the one before
            for before, after in zip(out, out[1:]):
                assert after.outputs[0].token_ids[:len(before.outputs[0].token_ids)] == before.outputs[0].token_ids
        assert len(got[3]) == 1  # final_only: one output, the finished one
        assert remote.get_stats().generation_tokens > 0
        asyncio.run(remote.check_integrity())
        with pytest.raises(ValueError, match="temperature"):
            asyncio.run(_run_all(remote, [("bad", "Hello", SamplingParams(temperature=-1.0))]))
    finally:
        local.shutdown()


def test_aborts_free_blocks_even_before_their_add(remote):
    async def scenario():
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = remote.generate(PROMPTS[0], long, "cancelled")
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()  # a client that went away: the replica aborts the request
        # An abort that reaches the engine before its add: the add must then be dropped.
        remote.core.abort.options(concurrency_group="control").remote("early")
        remote.core.add.options(concurrency_group="control").remote("early", None, [5, 6, 7], long)
        for _ in range(200):
            await asyncio.sleep(0.05)
            stats = remote.get_stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
                break
        stats = remote.get_stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        await remote.check_integrity()

    asyncio.run(scenario())


def test_a_dead_engine_actor_fails_requests_and_health(remote, ray_cluster):
    async def scenario():
        long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        stream = remote.generate(PROMPTS[0], long, "doomed")
        await stream.__anext__()
        ray_cluster.kill(remote.core)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            remote.check_health()

    asyncio.run(scenario())


def test_engine_core_merges_the_steps_between_two_polls(engine_kwargs):
    """A slow poller gets several steps' news in one delta per request; put together, they are the whole output
    the engine gives in-process (text with a stop string, tokens, logprobs, cumulative logprob, n = 2)."""
    params = [SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20, stop=["a"], ignore_eos=True)]
    local = LLMEngine.from_args(**engine_kwargs)
    expected = {}
    for i, p in enumerate(params):
        local.add_processed(f"r{i}", PROMPTS[i], local.tokenizer.encode(PROMPTS[i]), p)
    while local.has_unfinished_requests():
        expected.update({out.request_id: out for out in local.step() if out.finished})
    local.shutdown()
    core = EngineCore(engine_kwargs)
    try:
        got = {f"r{i}": {} for i in range(len(params))}
        for i, p in enumerate(params):
            core.add(f"r{i}", PROMPTS[i], core.engine.tokenizer.encode(PROMPTS[i]), p)
        num_polls, done = 0, set()
        while len(done) < len(params):
            time.sleep(0.2)  # several steps go by
            deltas, _, dead = core.poll(1.0)
            assert dead is None
            num_polls += 1
            for request_id, finished, error, _, choices in deltas:
                assert error is None
                for index, text, ids, logprobs, reason, _, cumulative in choices:
                    acc = got[request_id].setdefault(index, ["", [], [], None, None])
                    acc[0] += text
                    acc[1] += ids
                    acc[2] += logprobs or []
                    acc[3], acc[4] = reason, cumulative
                if finished:
                    done.add(request_id)
        assert num_polls < 25 + 2  # fewer polls than steps: deltas were merged
        for request_id, out in expected.items():
            for c in out.outputs:
                text, ids, logprobs, reason, cumulative = got[request_id][c.index]
                assert (text, ids, reason) == (c.text, c.token_ids, c.finish_reason)
                if c.logprobs is not None:
                    assert [x.keys() for x in logprobs] == [x.keys() for x in c.logprobs]
                    assert abs(cumulative - c.cumulative_logprob) < 1e-3
        core.check_integrity()
    finally:
        core.shutdown()


def test_engine_core_deltas_carry_only_what_is_new(engine_kwargs):
    """The poll's payload per request does not grow with the output (no Ray: the class itself)."""
    core = EngineCore(engine_kwargs)
    try:
        core.add("r", None, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1))
        tokens, text, sizes = [], "", []
        finished = False
        while not finished:
            deltas, _, dead = core.poll(1.0)
            assert dead is None
            for request_id, finished, error, _, choices in deltas:
                assert request_id == "r" and error is None
                (_, new_text, new_ids, new_logprobs, *_), = choices
                assert len(new_logprobs) == len(new_ids)
                sizes.append(len(new_ids))
                tokens += new_ids
                text += new_text
        assert len(tokens) == 30 and max(sizes) < 30
        core.check_integrity()
        # An aborted request leaves nothing behind, and its late outputs are not sent.
        core.add("gone", None, [5, 6], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
        while not any(d[0] == "gone" for d in core.poll(1.0)[0]):
            pass
        core.abort("gone")
        for _ in range(3):
            deltas, _, _ = core.poll(0.2)
            assert not deltas
        assert not core._known
        core.check_integrity()
    finally:
        core.shutdown()


def test_adds_and_aborts_of_one_event_loop_turn_go_in_one_ordered_call():
    """No Ray: the replica side's queue, with a stand-in for the actor method."""
    sent = []

    class Method:
        def remote(self, ops):
            sent.append(ops)

    engine = object.__new__(RemoteAsyncEngine)
    engine._ops, engine._closed, engine._apply = [], False, Method()

    async def burst():
        for i in range(5):
            engine._send(("add", f"r{i}", None, [1, 2], None))
        engine._send(("abort", "r1"))
        await asyncio.sleep(0)  # the turn ends: one call
        engine._send(("abort", "r3"))
        await asyncio.sleep(0)

    asyncio.run(burst())
    assert [[op[:2] for op in ops] for ops in sent] == [
        [("add", "r0"), ("add", "r1"), ("add", "r2"), ("add", "r3"), ("add", "r4"), ("abort", "r1")],
        [("abort", "r3")]]
