"""The Ray actor group on its own: placement, KV sizing over ranks, step errors, health, shutdown, and running
inside a caller's placement group (as a Serve replica does). Real Ray actors on CPU (gloo)."""

import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster import actor_group
from cluster.actor_group import RayExecutor, local_gpu_index
from cluster.executors import pick_executor
from cluster.placement import PLACEMENT_STRATEGY, ReplicaPlacement
from engine.config import EngineArgs
from engine.executor import ExecutorError
from engine.llm_engine import LLMEngine
from engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from tests.engines import llm_engine, the_executor

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3"]


def greedy_tokens(engine: LLMEngine, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    ids = [engine.add_request(None, p, params, stream=False) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.seqs[0].token_ids
    engine.check_integrity()
    return [done[i] for i in ids]


def placement_group_state(pg_id: str) -> str:
    return ray.util.placement_group_table()[pg_id]["state"]


def test_placement_bundles():
    assert ReplicaPlacement(1, "cuda").bundles() == [{"CPU": 1, "GPU": 1}]
    assert ReplicaPlacement(4, "cuda").bundles() == [{"CPU": 1, "GPU": 1}] + [{"GPU": 1}] * 3
    assert ReplicaPlacement(2, "cpu").bundles() == [{"CPU": 1}] * 2
    assert PLACEMENT_STRATEGY == "STRICT_PACK"


def test_local_gpu_index():
    assert local_gpu_index([3], visible="3") == 0  # Ray's default: the actor sees only its GPU
    assert local_gpu_index([3], visible="") == 3  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: sees all
    assert local_gpu_index(["5"], visible="4,5,6,7") == 1  # ... of a node that exposes only some GPUs


@pytest.mark.parametrize("use_compiled_graph", [True, False])
def test_executor_lifecycle(ray_cluster, tiny_checkpoints, monkeypatch, use_compiled_graph):
    from workers.kv_pool import KVLayout

    model_dir = tiny_checkpoints["llama"]
    reference = greedy_tokens(llm_engine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64))
    config = EngineArgs(model=model_dir, dtype="float32", device="cpu", tensor_parallel_size=2,
                        cpu_kv_cache_bytes=1 << 20).create_engine_config()
    executor = RayExecutor(config, use_compiled_graph=use_compiled_graph)
    assert executor.is_compiled_graph == use_compiled_graph
    pg_id = executor.placement_group.id.hex()
    assert placement_group_state(pg_id) == "CREATED"
    # Each rank holds 1 of the 2 KV heads; every rank profiles, the executor takes the minimum.
    assert executor.num_kv_blocks == (1 << 20) // KVLayout.per_head(2, 1, 16).bytes_per_block(16, torch.float32)

    engine = LLMEngine(config, the_executor(executor))
    assert greedy_tokens(engine) == reference

    # A bad step fails on every rank alike: an error for this step, not for the executor.
    bad = SchedulerOutput(cached_reqs=[CachedRequestData("unknown", [], 0)], num_scheduled_tokens={"unknown": 1})
    with pytest.raises(ExecutorError) as info:
        executor.execute_model(bad)
    assert not info.value.is_fatal and "KeyError" in str(info.value)
    executor.check_health()
    assert greedy_tokens(engine) == reference

    # Overlapped steps: the decode step goes out before the prefill's token is back; the ranks run them in order.
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    params.all_stop_token_ids = tuple(sorted(engine.eos_token_ids))  # as the engine fills them in
    prompt_ids = engine.process_prompt(PROMPTS[1], params)[1]
    n = len(prompt_ids)
    prefill = SchedulerOutput(new_reqs=[NewRequestData("overlap", prompt_ids, [], params, [0, 1], 0)],
                              num_scheduled_tokens={"overlap": n})
    decode = SchedulerOutput(cached_reqs=[CachedRequestData("overlap", [], n)], num_scheduled_tokens={"overlap": 1})
    first, second = executor.launch(prefill), executor.launch(decode)
    assert executor.collect(first).sampled_token_ids + executor.collect(second).sampled_token_ids == reference[1][:2]
    executor.execute_model(SchedulerOutput(finished_req_ids=["overlap"]))

    # A dead rank: check_health (which pings when no step ran lately) turns fatal, and so does every step.
    monkeypatch.setattr(actor_group, "HEALTH_CHECK_INTERVAL_S", 0.0)
    actors = list(executor.actors)
    ray.kill(actors[1])
    with pytest.raises(ExecutorError) as info:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ray.kill returns before the actor is gone
            executor.check_health()
            time.sleep(0.1)
    assert info.value.is_fatal
    with pytest.raises(ExecutorError) as info:
        executor.execute_model(SchedulerOutput())
    assert info.value.is_fatal

    executor.shutdown()
    executor.shutdown()
    assert placement_group_state(pg_id) == "REMOVED"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].ping.remote(), timeout=30)


@ray.remote
class Replica:
    """Stands in for a Serve replica: an actor in a placement group that starts an engine with tp=2 inside it."""

    def run(self, model_dir: str) -> dict:
        from ray.util.placement_group import get_current_placement_group

        config = EngineArgs(model=model_dir, dtype="float32", device="cpu", tensor_parallel_size=2,
                            num_kv_blocks=64).create_engine_config()
        try:
            RayExecutor(EngineArgs(model=model_dir, dtype="float32", device="cpu",
                                   tensor_parallel_size=4, num_kv_blocks=64).create_engine_config())
            too_large = None
        except ValueError as e:
            too_large = str(e)
        engine = LLMEngine(config, pick_executor)
        executor = engine.executor
        result = dict(own_pg=get_current_placement_group().id.hex(), executor_pg=executor.placement_group.id.hex(),
                      owns_pg=executor._owns_placement_group, is_compiled=executor.is_compiled_graph,
                      tokens=greedy_tokens(engine), too_large=too_large)
        engine.shutdown()
        return result


def test_executor_in_callers_placement_group(ray_cluster, tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"]
    reference = greedy_tokens(llm_engine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64))
    pg = placement_group(ReplicaPlacement(2, "cpu").bundles(), strategy=PLACEMENT_STRATEGY)
    ray.get(pg.ready(), timeout=60)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)
    replica = Replica.options(num_cpus=1, scheduling_strategy=strategy).remote()
    try:
        result = ray.get(replica.run.remote(model_dir), timeout=300)
    finally:
        ray.kill(replica)
    assert result["executor_pg"] == result["own_pg"] == pg.id.hex()
    assert not result["owns_pg"] and result["is_compiled"]  # no nested group
    assert "has 2 bundles" in result["too_large"]
    assert result["tokens"] == reference
    assert placement_group_state(pg.id.hex()) == "CREATED"  # the caller's group outlives the executor
    remove_placement_group(pg)
