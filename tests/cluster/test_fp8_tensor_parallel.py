"""FP8 under tensor parallelism on CPU: two Ray worker actors over gloo, each quantizing only its own shard.

The oracle quantizes o_proj and down_proj per row of each rank's K half (tests/fp8_oracle.py, tp=2), as the ranks
do; q/k/v, gate/up and the per-head KV scales are the same at any degree. Under preemption, chunked prefill and
prefix-cache hits (tests/cluster/test_tensor_parallel.py's stress settings).
"""

import pytest

from pagoda import LLM
from tests import fp8_oracle
from tests.cluster.test_tensor_parallel import STRESS
from tests.engine.test_fp8_parity import MAX_NEW, assert_matches, oracle, prompt_ids, run


def test_tp2_fp8_weights_and_kv_match_the_tp2_oracle(ray_cluster, tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    llm, outs = run(model_dir, tensor_parallel_size=2, **STRESS)
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits_tokens > 0
        workers = llm.engine.executor.describe()
        assert [w["kv_cache_dtype"] for w in workers] == ["float8_e4m3fn"] * 2
        assert_matches(oracle(model_dir, tp=2), outs)
        # Each rank's KV heads have the scales the whole model's heads have at tp 1 (per-head calibration).
        one_rank = LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", quantization="fp8",
                       num_kv_blocks=64)
        tp1 = one_rank.engine.executor.describe()[0]["kv_scales"]
        for layer, (k, v) in enumerate(tp1):
            assert [s for w in workers for s in w["kv_scales"][layer][0]] == k
            assert [s for w in workers for s in w["kv_scales"][layer][1]] == v
    finally:
        llm.shutdown()


@pytest.mark.slow  # 7-18 s of make test's 15 minutes on 2 cores: CI's slow suite runs it
def test_tp2_fp8_experts_match_the_tp2_oracle(ray_cluster, tiny_checkpoints):
    """Mixtral's FP8 experts (W8A8) at tp 2: each rank quantizes x per token, and its own slice of the SiLU-and-mul
    output per token for down, as the tp=2 oracle's experts do. (At the tiny model's size a scale over the whole
    row gives the same tokens within the tolerance too: the test pins the tp 2 path, not that detail.)"""
    model_dir = tiny_checkpoints["mixtral"]
    llm, outs = run(model_dir, tensor_parallel_size=2)
    try:
        assert_matches(oracle(model_dir, tp=2), outs)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp2_static_fp8_experts_match_the_oracle(ray_cluster, tiny_checkpoints, tmp_path):
    """A compressed-tensors FP8 Mixtral with static input scales at tp 2: each rank loads every expert's scales
    and keeps the largest (gate / up's, down's), so both ranks quantize the experts' inputs alike, by one scale
    (no tensor-parallel slice of it: the oracle is the tp 1 one)."""
    src = tiny_checkpoints["mixtral"]
    model_dir, weights, input_scales = fp8_oracle.write_fp8_checkpoint(src, str(tmp_path / "static"), "ct-static")
    llm, outs = run(model_dir, tensor_parallel_size=2, quantization=None, kv_cache_dtype="auto")
    try:
        model = fp8_oracle.oracle_model(src, weights=weights, input_scales=input_scales, kv_fp8=False)
        assert_matches(fp8_oracle.greedy(model, prompt_ids(model_dir), MAX_NEW), outs)
    finally:
        llm.shutdown()


def test_tp2_oracle_differs_from_tp1(tiny_checkpoints):
    """Sharded scales are a different quantization: the tp=2 oracle is not the tp=1 one (the test above can fail)."""
    model_dir = tiny_checkpoints["llama"]
    ids = prompt_ids(model_dir)[:2]
    one, two = (fp8_oracle.greedy(fp8_oracle.oracle_model(model_dir, tp=tp, kv_fp8=False), ids, MAX_NEW)
                for tp in (1, 2))
    assert any((a[1][i] - b[1][i]).abs().max() > 1e-4 for a, b in zip(one, two) for i in range(MAX_NEW))
