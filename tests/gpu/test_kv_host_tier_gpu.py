"""The host KV tier on a CUDA GPU (#30): pinned memory of exactly the asked size, moved by the copy engines;
offloads on their own stream, ordered after the compute stream's writes and before its later overwrites;
a prefix brought back from the host with CUDA graphs on."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.config import EngineArgs  # noqa: E402
from workers.kv_pool import HostKVPool, KVLayout, allocate_kv_caches  # noqa: E402
from workers.worker import InProcessExecutor  # noqa: E402

DEVICE = torch.device("cuda", 0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", [KVLayout.per_head(4, 8, 128), KVLayout.latent(4, 512, 64)],
                         ids=["per-head", "latent"])
def test_round_trip_through_pinned_memory(dtype, layout):
    caches = allocate_kv_caches(layout, 16, 16, dtype, DEVICE)
    for k, v in caches:
        for t in (k, v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    before = [(k.clone(), v.clone()) for k, v in caches]
    pool = HostKVPool(caches, num_blocks=12)
    # torch sees the registered buffer as pinned: its copies are asynchronous (not a copy, then a wait)
    assert pool.is_pinned and not pool.buffer.is_cuda and pool.buffer.is_pinned()
    pool.offload([(9, 3), (2, 11), (5, 0)])
    pool.wait_for_offloads()
    pool.onload([(3, 1), (0, 15), (11, 4)])
    torch.cuda.synchronize()
    for (k, v), (old_k, old_v), (host_k, host_v) in zip(caches, before, pool.caches):
        for new, old, host in ((k, old_k, host_k), (v, old_v, host_v)):
            assert same_bits(host[[3, 11, 0]], old[[9, 2, 5]])
            assert same_bits(new[[1, 15, 4]], old[[9, 5, 2]])


def test_offload_streams_are_ordered():
    """An offload reads what the compute stream wrote before it (however late that runs), and a write queued after
    wait_for_offloads cannot reach the device block before the offload read it."""
    caches = allocate_kv_caches(KVLayout.per_head(1, 8, 128), 4, 16, torch.bfloat16, DEVICE)
    k = caches[0][0]
    pool = HostKVPool(caches, num_blocks=4)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of compute-stream work ahead of the write
    k[0].fill_(1.0)
    pool.offload([(0, 2)])  # returns at once: queued on the copy stream behind the write
    assert pool.is_offloading
    pool.wait_for_offloads()
    k[0].fill_(2.0)  # the next step overwrites the block
    pool.onload([(2, 3)])
    torch.cuda.synchronize()
    assert torch.all(pool.caches[0][0][2] == 1.0) and torch.all(k[3] == 1.0) and torch.all(k[0] == 2.0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefix_from_the_host_tier_with_cuda_graphs(tiny_model_dir, kv_cache_dtype):
    from tests.workers.test_kv_host_tier import prefix_reuse_tokens

    config = EngineArgs(model=tiny_model_dir, dtype="float32", device="cuda", num_kv_blocks=16, num_host_kv_blocks=4,
                        kv_cache_dtype=kv_cache_dtype).create_engine_config()
    executor = InProcessExecutor(config)
    try:
        assert executor.worker.runner.graphs is not None and executor.worker.runner.host_pool.is_pinned
        a_tokens, b_tokens = prefix_reuse_tokens(executor.execute_model)
        assert b_tokens == a_tokens
    finally:
        executor.shutdown()
