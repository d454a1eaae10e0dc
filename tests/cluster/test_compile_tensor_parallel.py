"""compilation_config level 3 under tensor parallelism on CPU: two Ray worker actors over gloo, each compiling its
shard's forward, the all-reduces an opaque op in the graph (workers/parallel.py). Greedy tokens equal transformers'
under preemption, chunked prefill and prefix-cache hits."""

import pytest

from tests.cluster.test_tensor_parallel import STRESS
from tests.engine.test_llm_parity import assert_same_tokens, run_pagoda

pytestmark = pytest.mark.slow  # each rank compiles its graphs with inductor (about a minute on two cores)


def test_tp2_compiled_greedy_tokens_equal_transformers(ray_cluster, tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    llm, outs = run_pagoda(model_dir, tensor_parallel_size=2, compilation_config=3, **STRESS)
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits_tokens > 0
        assert_same_tokens(model_dir, outs)
    finally:
        llm.shutdown()
