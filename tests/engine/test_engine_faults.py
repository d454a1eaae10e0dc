"""One request that breaks its step fails alone: the others of that step are retried one at a time and finish
with the tokens they would have had anyway; nothing leaks. A stalled engine fails the replica's health check.

The failure is injected (a real in-process executor that raises for one request: nothing real fails on demand);
everything else is the real engine on the tiny model."""

import asyncio
import time

import pytest

from cluster.executors import pick_executor
from engine.config import EngineArgs
from engine.errors import EngineDeadError
from engine.executor import ExecutorError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engines import local_async_engine, the_executor
from workers.worker import InProcessExecutor

PROMPTS = ["Once upon a time", "The quick brown fox", "def fibonacci(n):", "Hello"]


class PoisonedExecutor(InProcessExecutor):
    """Fails (not fatally) every step that schedules the request "poison", before the model runs."""

    def __init__(self, config):
        super().__init__(config)
        self.num_failed_steps = 0

    def launch(self, sched):
        if "poison" in sched.num_scheduled_tokens:
            self.num_failed_steps += 1
            raise ExecutorError("injected failure of the poison request")
        return super().launch(sched)


def run(engine, requests):
    for request_id, prompt in requests:
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                           stream=False)
    done = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done[delta.request_id] = delta
    return done


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_that_breaks_its_step_fails_alone(tiny_model_dir, overlap):
    config = EngineArgs(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=128).create_engine_config()
    named = [(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    reference = run(LLMEngine(config, pick_executor), named)
    engine = LLMEngine(config, the_executor(PoisonedExecutor(config)))
    engine.executor.supports_overlap = overlap
    done = run(engine, named[:2] + [("poison", "Hello there")] + named[2:])
    assert done["poison"].error and done["poison"].seqs[0].finish_reason == "error"
    for request_id, _ in named:
        assert done[request_id].error is None and done[request_id].seqs[0].finish_reason == "length"
        assert done[request_id].seqs[0].token_ids == reference[request_id].seqs[0].token_ids
    assert engine.executor.num_failed_steps >= 2  # the shared step, then the poison alone
    engine.step()
    engine.check_integrity()
    assert engine.get_stats().num_finished == {"length": len(PROMPTS), "error": 1}
    engine.shutdown()


def test_a_stalled_engine_fails_the_health_check(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, device="cpu", num_kv_blocks=64).create_engine_config()
    engine = local_async_engine(config, stall_timeout_s=1.0)

    async def scenario():
        engine.connection.core.loop.submit(lambda: time.sleep(4))  # the step thread hangs (a stuck device)
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), "waits")
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(2.5)
        with pytest.raises(EngineDeadError, match="no step"):
            engine.check_health()
        await asyncio.wait_for(pending, 30)  # the engine comes back: the request goes on
        await stream.aclose()
        engine.check_health()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_an_engine_idle_since_its_start_is_not_stalled_when_work_arrives(tiny_model_dir, monkeypatch):
    """The stall clock starts when work arrives, not when the engine was built: a replica that served nothing for
    longer than its stall timeout takes a burst without failing its health check (it answered 503 "restarting").
    The stall timeout is read from $PAGODA_ENGINE_STALL_S; the test drives the engine's clock, so how slow this
    machine is changes nothing: no real second passes on that clock while the burst runs."""
    monkeypatch.setenv("PAGODA_ENGINE_STALL_S", "30")
    now = [0.0]
    config = EngineArgs(model=tiny_model_dir, device="cpu", num_kv_blocks=64).create_engine_config()
    engine = local_async_engine(config, clock=lambda: now[0])
    assert engine.stall_timeout_s == 30.0

    async def one(i):
        engine.check_health()  # what the replica asks before it accepts a request
        stream = engine.generate([5, 6, 7 + i], SamplingParams(max_tokens=4, ignore_eos=True), f"burst-{i}",
                                 stream=False)
        return [delta async for batch in stream for delta in batch]

    async def scenario():
        now[0] += 1000.0  # idle for far longer than the stall timeout, then a burst
        outputs = await asyncio.gather(*(one(i) for i in range(8)))
        assert all(len(deltas) == 1 and deltas[0].finished and deltas[0].error is None for deltas in outputs)
        assert [len(deltas[0].seqs[0].token_ids) for deltas in outputs] == [4] * 8
        engine.check_health()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
