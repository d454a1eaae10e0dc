"""The engine actor beside a Serve replica, on a GPU: it takes the GPU and gives the in-process engine's tokens."""

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("ray")

from cluster.engine_core import RayConnection  # noqa: E402
from cluster.placement import ReplicaPlacement  # noqa: E402
from cluster.ray_utils import actor_env_vars  # noqa: E402
from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.config import EngineArgs  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402


def test_engine_actor_on_a_gpu_matches_in_process(tiny_checkpoints, ray_cluster):
    kwargs = {"model": tiny_checkpoints["llama"], "device": "cuda", "dtype": "float32", "num_kv_blocks": 256}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "def fibonacci(n: int) -> list[int]:"]
    llm = LLM(**kwargs)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    options = ReplicaPlacement(1, "cuda").engine_actor_options(actor_env_vars())
    assert options["num_gpus"] == 1
    config = EngineArgs(**kwargs).create_engine_config()
    remote = AsyncLLMEngine(config, RayConnection(config, options))

    async def run():
        async def one(i, prompt):
            _, ids = remote.process_prompt(prompt, params)
            return [d async for batch in remote.generate(ids, params, f"r{i}", stream=False) for d in batch][-1]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(run())
        assert [o.seqs[0].token_ids for o in outs] == expected
        asyncio.run(remote.check_integrity())
    finally:
        remote.shutdown()
