"""LLMServer's stream batching, on the replica class itself (no Serve): fewer, larger deltas, the same text."""

import asyncio
import time

from cluster.protocol import GenerateRequest
from cluster.server import LLMServer
from engine.sampling_params import SamplingParams


def _collect(server, request_id: str) -> list:
    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        request = GenerateRequest(request_id=request_id, params=params, prompt="Once upon a time", stream=True)
        return [delta async for delta in server.generate(request)]

    return asyncio.run(run())


def test_stream_interval_batches_tokens_without_losing_any(tiny_model_dir):
    server_class = LLMServer.func_or_class
    kwargs = {"model": tiny_model_dir, "device": "cpu", "num_kv_blocks": 64}
    every_step = server_class(kwargs, "tiny", stream_interval_s=0.0, engine_process=False)
    batched = server_class(kwargs, "tiny", stream_interval_s=60.0, engine_process=False)
    try:
        fine = _collect(every_step, "a")
        start = time.monotonic()
        coarse = _collect(batched, "b")
        coarse_s = time.monotonic() - start
    finally:
        every_step.engine.shutdown()
        batched.engine.shutdown()

    def text_and_tokens(deltas):
        chunks = [c for d in deltas for c in d.choices]
        return "".join(c.text for c in chunks), sum(c.num_tokens for c in chunks), len(chunks)

    fine_text, fine_tokens, fine_chunks = text_and_tokens(fine)
    coarse_text, coarse_tokens, coarse_chunks = text_and_tokens(coarse)
    assert fine_tokens == coarse_tokens == 24 and coarse_text == fine_text
    assert fine_chunks >= 12 and coarse_chunks == 2  # the first token at once, then everything at the end
    assert coarse_s < 30  # the end is sent when it comes, not when the 60 s interval is over
