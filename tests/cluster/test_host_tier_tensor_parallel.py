"""The host KV tier at tensor_parallel_size 2: real Ray actors over gloo (the worker-side tests are
tests/workers/test_kv_host_tier.py)."""

import pytest

from cluster.actor_group import RayExecutor
from engine.config import EngineArgs
from tests.workers.test_kv_host_tier import prefix_reuse_tokens
from workers.worker import InProcessExecutor


@pytest.mark.slow  # 7-18 s of make test's 15 minutes on 2 cores: CI's slow suite runs it
def test_tensor_parallel_ranks_move_blocks(ray_cluster, tiny_checkpoints):
    """tp 2 over gloo, real Ray actors: the group reports its host blocks, and every rank's moves keep the greedy
    tokens those of one rank."""
    model_dir = tiny_checkpoints["llama"]
    args = {"model": model_dir, "dtype": "float32", "device": "cpu", "num_kv_blocks": 16, "num_host_kv_blocks": 4}
    single = InProcessExecutor(EngineArgs(**args).create_engine_config())
    try:
        reference = prefix_reuse_tokens(single.execute_model)
        single_block_bytes = single.kv_block_bytes
    finally:
        single.shutdown()
    assert reference[0] == reference[1]
    executor = RayExecutor(EngineArgs(tensor_parallel_size=2, **args).create_engine_config())
    try:
        assert executor.num_host_kv_blocks == 4
        assert executor.kv_block_bytes == single_block_bytes  # each rank's half of every block, summed
        assert prefix_reuse_tokens(executor.execute_model) == reference
    finally:
        executor.shutdown()
