"""LLMServer on the replica class itself (no Serve): what it yields is Accepted, then the engine's deltas
forwarded in batches; a long stream interval means fewer deltas and the same text."""

import asyncio
import time

from cluster.placement import ReplicaPlacement
from cluster.protocol import Accepted, GenerateRequest
from cluster.server import LLMServer, ServerSettings
from engine.config import EngineArgs
from engine.sampling_params import SamplingParams


def _collect(server, request_id: str) -> list:
    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        request = GenerateRequest(request_id=request_id, params=params, prompt="Once upon a time", stream=True)
        return [item async for item in server.generate(request)]

    return asyncio.run(run())


def test_stream_interval_batches_tokens_without_losing_any(tiny_model_dir):
    server_class = LLMServer.func_or_class
    settings = ServerSettings("tiny", ReplicaPlacement(1, "cpu", engine_process=False))
    args = EngineArgs(model=tiny_model_dir, device="cpu", num_kv_blocks=64)
    every_step = server_class(EngineArgs(**{**args.__dict__, "stream_interval_s": 0.0}), settings)
    batched = server_class(EngineArgs(**{**args.__dict__, "stream_interval_s": 60.0}), settings)
    try:
        fine = _collect(every_step, "a")
        start = time.monotonic()
        coarse = _collect(batched, "b")
        coarse_s = time.monotonic() - start
    finally:
        every_step.engine.shutdown()
        batched.engine.shutdown()

    def text_and_tokens(items):
        assert isinstance(items[0], Accepted) and items[0].num_prompt_tokens > 0
        seqs = [s for batch in items[1:] for d in batch for s in d.seqs]
        return "".join(s.text for s in seqs), sum(len(s.token_ids) for s in seqs), len(seqs)

    fine_text, fine_tokens, fine_chunks = text_and_tokens(fine)
    coarse_text, coarse_tokens, coarse_chunks = text_and_tokens(coarse)
    assert fine_tokens == coarse_tokens == 24 and coarse_text == fine_text
    assert fine_chunks >= 12 and coarse_chunks == 2  # the first token at once, then everything at the end
    assert coarse_s < 30  # the end is sent when it comes, not when the 60 s interval is over
