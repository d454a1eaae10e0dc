"""The engine actor beside a Serve replica, on a GPU: it takes the GPU and gives the in-process engine's tokens."""

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("ray")

from cluster.engine_core import RemoteAsyncEngine, core_actor_options  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def test_engine_actor_on_a_gpu_matches_in_process(tiny_checkpoints, ray_cluster):
    kwargs = {"model": tiny_checkpoints["llama"], "device": "cuda", "dtype": "float32", "num_kv_blocks": 256}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "def fibonacci(n: int) -> list[int]:"]
    llm = LLM(**kwargs)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    options = core_actor_options(kwargs)
    assert options["num_gpus"] == 1
    remote = RemoteAsyncEngine(kwargs, options)

    async def run():
        async def one(i, prompt):
            return [out async for out in remote.generate(prompt, params, f"r{i}")][-1]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(run())
        assert [o.outputs[0].token_ids for o in outs] == expected
        asyncio.run(remote.check_integrity())
    finally:
        remote.shutdown()
