"""The Ray actor-group executor on a GPU: NCCL process group, CUDA graphs and Triton inside a worker actor."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
ray = pytest.importorskip("ray")

from pagoda import LLM, SamplingParams  # noqa: E402


def test_actor_group_on_gpu_matches_in_process(tiny_checkpoints, ray_cluster):
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "def fibonacci(n: int) -> list[int]:"]
    local = LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cuda", num_kv_blocks=256)
    expected = [o.outputs[0].token_ids for o in local.generate(prompts, params, use_tqdm=False)]
    local.shutdown()
    del local
    remote = LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cuda", num_kv_blocks=256, use_ray=True)
    got = [o.outputs[0].token_ids for o in remote.generate(prompts, params, use_tqdm=False)]
    remote.engine.check_integrity()
    remote.shutdown()
    assert got == expected
