"""The engine core behind AsyncLLMEngine, in-process and in its own Ray actor (cluster/engine_core.py): the same
deltas either way, aborts that end requests before they could have finished (also one that overtakes its add),
a dead engine actor reported as such, and a poll's payload that holds only what is new."""

import asyncio
import time

import pytest

from cluster.engine_core import RayConnection
from cluster.executors import pick_executor
from cluster.placement import ReplicaPlacement
from cluster.ray_utils import actor_env_vars
from engine.async_engine import AsyncLLMEngine, CoreConnection, LocalConnection
from engine.config import EngineArgs
from engine.core import AbortRequest, AddRequest, EngineCore, PollResult
from engine.errors import EngineDeadError
from engine.request_output import RequestDelta, RequestError, SequenceDelta
from engine.sampling_params import SamplingParams
from tests.engines import local_async_engine

PROMPTS = ["Once upon a time", "The quick brown fox", "def fibonacci(n):"]


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return EngineArgs(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=256,
                      stream_interval_s=0.0, chat_template=CHAT_TEMPLATE).create_engine_config()


@pytest.fixture
def remote(ray_cluster, config):
    """A fresh engine actor and its replica-side client; shut down after the test (a warning if it is dead)."""
    options = ReplicaPlacement(1, "cpu").engine_actor_options(actor_env_vars())
    engine = AsyncLLMEngine(config, RayConnection(config, options))
    yield engine
    engine.shutdown()


async def _collect(engine, request_id, prompt, params, stream=True):
    _, token_ids = engine.process_prompt(prompt, params)
    return [d async for batch in engine.generate(token_ids, params, request_id, stream) for d in batch]


def _requests():
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    pair = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True)
    stop = SamplingParams(temperature=0.0, max_tokens=20, stop=["e"], ignore_eos=True)
    return [("g", PROMPTS[0], greedy), ("n2", PROMPTS[1], pair), ("s", PROMPTS[2], stop),
            ("f", PROMPTS[0], greedy, False)]


def _joined(deltas):
    """index -> (text, token ids, logprob entries, finish reason, stop reason) of a request's deltas put together."""
    out = {}
    for delta in deltas:
        for s in delta.seqs:
            text, ids, lps, _, _ = out.get(s.index, ("", [], [], None, None))
            out[s.index] = (text + s.text, ids + s.token_ids, lps + (s.logprobs or []), s.finish_reason,
                            s.stop_reason)
    return out


def test_remote_engine_gives_the_in_process_deltas(remote, config):
    local = local_async_engine(config)
    assert remote.tokenizer.chat_template == local.tokenizer.chat_template == CHAT_TEMPLATE  # the override

    async def run(engine):
        return await asyncio.gather(*(_collect(engine, *r) for r in _requests()))

    try:
        expected, got = asyncio.run(run(local)), asyncio.run(run(remote))
        for exp, out in zip(expected, got):
            assert out[-1].finished and not any(d.finished for d in out[:-1])
            a, b = _joined(exp), _joined(out)
            assert a.keys() == b.keys()
            for index in a:
                assert a[index][0:2] + a[index][3:] == b[index][0:2] + b[index][3:]
                # another process, another thread count: float sums may round apart
                for x, y in zip(a[index][2], b[index][2]):
                    assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                    assert [t for t, _, _ in x.top] == [t for t, _, _ in y.top]
        assert len(got[3]) == 1  # stream=False: one delta, the finished one, with the whole output
        assert remote.get_stats().generation_tokens > 0
        asyncio.run(remote.check_integrity())
    finally:
        local.shutdown()


def test_aborts_end_requests_early_even_before_their_add(remote):
    async def scenario():
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        _, token_ids = remote.process_prompt(PROMPTS[0], long)
        stream = remote.generate(token_ids, long, "cancelled")
        first = await stream.__anext__()
        assert not first[-1].finished
        await stream.aclose()  # a client that went away: the replica aborts the request
        # An abort that reaches the engine before its add: the add must then be dropped.
        remote.connection.send([AbortRequest("early"), AddRequest("early", [5, 6, 7], long)])
        for _ in range(200):
            await asyncio.sleep(0.05)
            stats = remote.get_stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
                break
        stats = remote.get_stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        assert stats.num_finished == {"abort": 1}  # "early" never ran
        assert stats.generation_tokens < 200  # "cancelled" stopped before it could have finished
        await remote.check_integrity()

    asyncio.run(scenario())


def test_a_dead_engine_actor_fails_requests_and_health(remote, ray_cluster):
    async def scenario():
        long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        stream = remote.generate([5, 6, 7], long, "doomed")
        await stream.__anext__()
        ray_cluster.kill(remote.connection.actor)

        async def drain():
            async for _ in stream:
                pass

        with pytest.raises(EngineDeadError):  # ends, rather than waiting for good (the bound: a hang, not a speed)
            await asyncio.wait_for(drain(), timeout=120)
        with pytest.raises(EngineDeadError):
            remote.check_health()

    asyncio.run(scenario())


def test_a_slow_poller_gets_every_step_in_one_poll(config):
    """Deltas wait in the outbox unmerged; a poll takes them all, and together they are the whole output a
    request that does not stream gets in its one delta (text with a stop string, tokens, logprobs, n = 2)."""
    params = [SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20, stop=["a"], ignore_eos=True)]
    core = EngineCore(config, pick_executor)
    try:
        ids = [core.engine.tokenizer.encode(p) for p in PROMPTS[:2]]
        core.apply([AddRequest(f"whole{i}", ids[i], p, stream=False) for i, p in enumerate(params)])
        core.apply([AddRequest(f"r{i}", ids[i], p) for i, p in enumerate(params)])
        got, num_polls = {}, 0
        while sum(d.finished for ds in got.values() for d in ds) < 2 * len(params):
            time.sleep(0.2)  # several steps go by
            result = core.poll(1.0)
            assert result.dead_error is None
            num_polls += 1
            for delta in result.deltas:
                assert delta.error is None
                got.setdefault(delta.request_id, []).append(delta)
        assert num_polls < 25  # fewer polls than steps: each took several steps' deltas
        assert max(len(got[f"r{i}"]) for i in range(2)) > num_polls  # ... unmerged
        for i in range(len(params)):
            (whole,) = got[f"whole{i}"]
            assert _joined(got[f"r{i}"]) == _joined([whole])
        core.check_integrity()
    finally:
        core.shutdown()


def test_deltas_carry_only_what_is_new_and_aborts_leave_nothing(config):
    core = EngineCore(config, pick_executor)
    try:
        core.apply([AddRequest("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                              logprobs=1))])
        tokens, sizes, finished = [], [], False
        while not finished:
            for delta in core.poll(1.0).deltas:
                (seq,) = delta.seqs
                assert len(seq.logprobs) == len(seq.token_ids)
                sizes.append(len(seq.token_ids))
                tokens += seq.token_ids
                finished = delta.finished
        assert len(tokens) == 30 and max(sizes) < 30
        core.apply([AddRequest("gone", [5, 6], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))])
        while not any(d.request_id == "gone" for d in core.poll(1.0).deltas):
            pass
        core.apply([AbortRequest("gone")])
        last = [d for d in core.poll(1.0).deltas if d.request_id == "gone"]
        assert last[-1].finished and last[-1].seqs[0].finish_reason == "abort"
        assert not core._known
        core.check_integrity()
    finally:
        core.shutdown()


def test_an_add_the_engine_refuses_fails_that_request_as_invalid(config):
    """A ParamError from the engine's add is the request's fault: its last delta carries an INVALID RequestError
    (a 400 at the edge), not a generic failure (a 500). A request id already in use is refused so (AsyncLLMEngine
    never sends one: the second add is sent by hand); the first request runs on."""
    core = EngineCore(config, pick_executor)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        core.apply([AddRequest("r", [5, 6, 7], params), AddRequest("r", [5, 6, 7], params)])
        finished = []
        while len(finished) < 2:
            finished += [d for d in core.poll(1.0).deltas if d.finished]
        failed = [d for d in finished if d.error is not None]
        assert len(failed) == 1 and failed[0].error == RequestError("request id 'r' is already in use",
                                                                    RequestError.INVALID, None)
        core.check_integrity()
    finally:
        core.shutdown()


class _Recorder(CoreConnection):
    """Records what AsyncLLMEngine sends, and answers polls from a real in-process core."""

    def __init__(self, config):
        self.local = LocalConnection(config, pick_executor)
        self.sent = []

    def start(self):
        return self.local.start()

    def send(self, messages):
        self.sent.append([(type(m).__name__, m.request_id) for m in messages])
        self.local.send(messages)

    async def poll(self, timeout_s):
        return await self.local.poll(timeout_s)

    async def check_integrity(self):
        await self.local.check_integrity()

    def check_health(self):
        self.local.check_health()

    def fail(self, reason):
        self.local.fail(reason)

    def shutdown(self):
        self.local.shutdown()


def test_the_messages_of_one_event_loop_turn_go_in_one_ordered_call(config):
    recorder = _Recorder(config)
    engine = AsyncLLMEngine(config, recorder)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def burst():
        gens = [engine.generate([5, 6], params, f"r{i}") for i in range(4)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)  # every generator has queued its add: one call at the end of this turn
        await asyncio.wait_for(asyncio.gather(*firsts), 30)
        for g in gens:
            await g.aclose()

    try:
        asyncio.run(burst())
        assert recorder.sent[0] == [("AddRequest", f"r{i}") for i in range(4)]
    finally:
        engine.shutdown()


class _DiesAfterFailing(_Recorder):
    """A core whose loop dies in the step that fails the requests: one poll brings their error finishes and the
    death together (as when a worker dies mid-step). The core itself is real; only that one poll is made up."""

    async def poll(self, timeout_s):
        result = await self.local.poll(timeout_s)
        added = [request_id for call in self.sent for kind, request_id in call if kind == "AddRequest"]
        if not added:
            return result
        failed = [RequestDelta(r, [SequenceDelta(0, finish_reason="error")], finished=True,
                               error=RequestError("step failed")) for r in added]
        return PollResult(failed, result.stats, [], dead_error="worker died")


def test_a_request_failed_in_the_step_that_killed_the_engine_ends_with_its_error_finish(config):
    engine = AsyncLLMEngine(config, _DiesAfterFailing(config))
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    try:
        deltas = asyncio.run(_collect(engine, "r", PROMPTS[0], params))
        assert deltas[-1].finished and deltas[-1].error == RequestError("step failed")
        assert deltas[-1].seqs[0].finish_reason == "error"
        with pytest.raises(EngineDeadError, match="worker died"):
            engine.check_health()
    finally:
        engine.shutdown()
