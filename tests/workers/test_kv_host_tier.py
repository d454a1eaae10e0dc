"""The host-memory KV tier on the ranks (#30): the host pool's layout, bit-exact moves between the tiers, the order of
a step's moves on a real ModelRunner (offloads, copy-on-write, onloads), sizing, and a tp 2 Ray actor group that
moves blocks. CPU only: on CUDA the same copies run through the pool's pinned memory (tests/gpu has the stream
tests)."""

import pytest
import torch

from engine.config import CacheConfig, EngineArgs
from engine.executor import ExecutorError
from engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from workers.kv_pool import HostKVPool, KVLayout, allocate_kv_caches, num_host_blocks
from workers.worker import InProcessExecutor


def random_pool(layout: KVLayout, num_blocks, block_size, dtype):
    caches = allocate_kv_caches(layout, num_blocks, block_size, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for k, v in caches:  # random bits (FP8 too: NaN patterns included, so compare bytes)
        for t in (k, v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=generator,
                                                    dtype=torch.uint8))
    return caches


def snapshot(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size,layout", [(4, KVLayout.per_head(3, 2, 8)), (1, KVLayout.per_head(3, 1, 3)),
                                               (2, KVLayout.latent(3, 12, 4)), (1, KVLayout.latent(3, 6, 5))],
                         ids=["wide-words", "odd-bytes", "latent", "latent-odd-bytes"])
def test_round_trip_is_bit_exact(dtype, block_size, layout):
    """Per-head K and V, and a latent pool's latents and rope keys (two shapes a layer)."""
    device_caches = random_pool(layout, 8, block_size, dtype)
    before = snapshot(device_caches)
    pool = HostKVPool(device_caches, num_blocks=6)
    assert not pool.is_pinned  # plain memory on CPU
    assert pool.num_bytes == 6 * layout.bytes_per_block(block_size, dtype)
    for (host_k, host_v), (k, v) in zip(pool.caches, device_caches):
        assert host_k.shape == (6, *k.shape[1:]) and host_v.shape == (6, *v.shape[1:])
        assert host_k.dtype == host_v.dtype == dtype

    pool.offload([(5, 2), (1, 0), (3, 5)])  # pairs in any order
    pool.onload([(5, 0), (0, 7), (2, 4)])  # into other device blocks
    for layer, ((k, v), (old_k, old_v), (host_k, host_v)) in enumerate(zip(device_caches, before, pool.caches)):
        for new, old, host in ((k, old_k, host_k), (v, old_v, host_v)):
            assert same_bits(host[[2, 0, 5]], old[[5, 1, 3]]), layer
            assert same_bits(new[[0, 7, 4]], old[[3, 1, 5]]), layer
            untouched = [1, 2, 3, 5, 6]
            assert same_bits(new[untouched], old[untouched]), layer


def test_num_host_blocks():
    block_bytes = KVLayout.per_head(2, 2, 16).bytes_per_block(16, torch.float32)
    assert num_host_blocks(CacheConfig(), block_bytes) == 0
    assert num_host_blocks(CacheConfig(swap_space_gib=1.5), block_bytes) == int(1.5 * 2**30) // block_bytes
    assert num_host_blocks(CacheConfig(swap_space_gib=1.5, num_host_kv_blocks=7), block_bytes) == 7


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_worker_reports_host_blocks(tiny_model_dir, kv_cache_dtype):
    config = EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu", num_kv_blocks=16, swap_space=0.001,
                        kv_cache_dtype=kv_cache_dtype).create_engine_config()
    executor = InProcessExecutor(config)
    try:
        worker = executor.worker
        assert executor.num_host_kv_blocks == int(0.001 * 2**30) // worker.block_bytes > 0
        pool = worker.runner.host_pool
        assert pool.num_blocks == executor.num_host_kv_blocks
        k_cache = worker.runner.kv_caches[0][0]
        assert pool.caches[0][0].dtype == k_cache.dtype == worker.kv_dtype
        assert pool.caches[0][0].shape[1:] == k_cache.shape[1:]
    finally:
        executor.shutdown()
    executor = InProcessExecutor(EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu",
                                            num_kv_blocks=16).create_engine_config())
    try:
        assert executor.num_host_kv_blocks == 0 and executor.worker.runner.host_pool is None
    finally:
        executor.shutdown()


@pytest.fixture
def executor(tiny_model_dir):
    """One rank on CPU: 16 device blocks of 16 tokens, 4 host blocks."""
    config = EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu", num_kv_blocks=16,
                        num_host_kv_blocks=4).create_engine_config()
    executor = InProcessExecutor(config)
    yield executor
    executor.shutdown()


def block(caches, block_id):
    return [(k[block_id].clone(), v[block_id].clone()) for k, v in caches]


def test_a_step_makes_its_three_kinds_of_moves(executor):
    """Offloads, copy-on-write and onloads of one step, into blocks no other move of it touches (the block
    manager's rules); a step that would write a block it offloads is refused as a failed move: fatal."""
    runner = executor.worker.runner
    prompt = list(range(3, 43))  # 40 tokens: blocks 0 and 1 full, 2 partly
    runner.execute_model(SchedulerOutput(
        new_reqs=[NewRequestData("a", prompt, [], SamplingParams(temperature=0.0), [0, 1, 2], 0)],
        num_scheduled_tokens={"a": 40}))
    first, second = block(runner.kv_caches, 0), block(runner.kv_caches, 1)
    assert not torch.equal(first[0][0], second[0][0])
    runner.execute_model(SchedulerOutput(finished_req_ids=["a"], kv_offloads=[(1, 1)]))
    runner.execute_model(SchedulerOutput(kv_offloads=[(0, 2)], block_copies=[(0, 5)], kv_onloads=[(1, 6)]))
    host = runner.host_pool.caches
    for (k, v), (first_k, first_v), (second_k, second_v), (host_k, host_v) in zip(
            runner.kv_caches, first, second, host):
        assert same_bits(host_k[2], first_k) and same_bits(host_v[2], first_v)  # offloaded
        assert same_bits(k[5], first_k) and same_bits(v[5], first_v)  # copied on write
        assert same_bits(k[6], second_k) and same_bits(v[6], second_v)  # brought back from host block 1
    with pytest.raises(ExecutorError, match="writes a device block it offloads") as failed:
        executor.execute_model(SchedulerOutput(kv_offloads=[(0, 3)], kv_onloads=[(1, 0)]))
    assert failed.value.is_fatal


def prefix_reuse_tokens(execute, onload: bool = True, num_tokens: int = 4) -> tuple[list[int], list[int]]:
    """Request a computes a 40-token prompt and its blocks 0 and 1 go to host blocks 0 and 1 (the step that ends
    it), then another request takes them over; request b, with a's prompt, gets them back into blocks 5 and 6 and
    computes only the last 8 tokens. Returns (a's greedy tokens, b's).
    `execute(SchedulerOutput) -> ModelRunnerOutput`."""
    prompt, greedy = list(range(3, 43)), SamplingParams(temperature=0.0)

    def generate(req_id, new_request, moves):
        tokens = execute(SchedulerOutput(new_reqs=[new_request], num_scheduled_tokens={
            req_id: len(new_request.prompt_token_ids) - new_request.num_computed_tokens}, **moves)).sampled_token_ids
        for i in range(num_tokens - 1):
            tokens += execute(SchedulerOutput(cached_reqs=[CachedRequestData(req_id, [], len(prompt) + i)],
                                              num_scheduled_tokens={req_id: 1})).sampled_token_ids
        return tokens

    a_tokens = generate("a", NewRequestData("a", prompt, [], greedy, [0, 1, 2], 0), {})
    execute(SchedulerOutput(finished_req_ids=["a"], kv_offloads=[(0, 0), (1, 1)]))
    execute(SchedulerOutput(num_scheduled_tokens={"x": 32},
                            new_reqs=[NewRequestData("x", list(range(50, 82)), [], greedy, [0, 1], 0)]))
    execute(SchedulerOutput(finished_req_ids=["x"]))
    moves = {"kv_onloads": [(0, 5), (1, 6)]} if onload else {}
    b_tokens = generate("b", NewRequestData("b", prompt, [], greedy, [5, 6, 7], 32), moves)
    execute(SchedulerOutput(finished_req_ids=["b"]))
    return a_tokens, b_tokens


def test_prefix_from_the_host_tier(executor):
    a_tokens, b_tokens = prefix_reuse_tokens(executor.execute_model)
    assert len(a_tokens) == 4 and b_tokens == a_tokens


def test_prefix_without_its_onload_differs(executor):
    """The control: the same steps with the onload left out give other tokens (the test above has power)."""
    _, b_tokens = prefix_reuse_tokens(executor.execute_model, onload=False)
    a_tokens, _ = prefix_reuse_tokens(executor.execute_model)
    assert b_tokens != a_tokens


def test_runs_of_consecutive_host_blocks_are_one_copy_each():
    from workers.kv_pool import _runs

    assert _runs([4, 5, 6, 2, 3, 9, 8]) == [(0, (4, 3)), (3, (2, 2)), (5, (9, 1)), (6, (8, 1))]
    assert _runs([]) == []


@pytest.mark.parametrize("layout", [KVLayout.per_head(3, 2, 8), KVLayout.latent(3, 12, 4)],
                         ids=["per-head", "latent"])
def test_the_device_pool_is_its_allocations_and_a_host_block_is_contiguous(layout):
    """Per-head: one device allocation [layers, 2, blocks, ...]; latent: one for the latents, one for the rope keys.
    Either way a host block is every layer's pair of its device block, first tensor then second, layer after layer,
    in one contiguous run."""
    from workers.kv_pool import kv_buffers

    caches = random_pool(layout, 8, 4, torch.bfloat16)
    assert len(kv_buffers(caches)) == (2 if layout.is_latent else 1)
    pool = HostKVPool(caches, num_blocks=5)
    pool.offload([(6, 1), (7, 2), (0, 4)])
    block = pool.buffer[2]  # host block 2: device block 7
    assert block.is_contiguous()
    assert torch.equal(block.flatten(), torch.cat([t[7].flatten() for kv in caches for t in kv]))
    with pytest.raises(ValueError, match="allocations of allocate_kv_caches"):
        kv_buffers([(k.clone(), v) for k, v in caches])
