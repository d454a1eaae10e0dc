"""Tensor parallelism over NCCL on two or more GPUs: the same greedy tokens as one GPU."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
ray = pytest.importorskip("ray")

from pagoda import LLM, SamplingParams  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "qwen2_moe"])  # MoE: experts split on their rows
def test_tp2_matches_tp1_on_gpus(tiny_checkpoints, ray_cluster, arch):
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=1)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "def fibonacci(n: int) -> list[int]:"]
    runs = []
    for tp in (1, 2):
        llm = LLM(model=tiny_checkpoints[arch], dtype="float32", device="cuda", num_kv_blocks=256,
                  tensor_parallel_size=tp, use_ray=True)
        if tp > 1:  # two NVLink GPUs: the one-shot symmetric-memory all-reduce, not NCCL
            assert all(w["all_reduce"].startswith("symmetric-memory") for w in llm.engine.executor.describe())
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.engine.check_integrity()
        llm.shutdown()
    for one, two in zip(*runs):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            for token_id, lp in a.items():
                assert abs(lp - b[token_id]) < 1e-3
