"""The symmetric-memory all-reduce on two GPUs: the same sums as NCCL, eagerly and inside a CUDA graph."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.ports import free_port

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)


def _rank_main(rank: int, port: int, results) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    from workers import parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel.init_parallel(rank, 2, "nccl", f"tcp://127.0.0.1:{port}")
    try:
        in_use = parallel.init_symmetric_all_reduce(torch.bfloat16, device, max_bytes=1 << 20)
        gen = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(64, 512, device=device, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(256, 512, device=device, dtype=torch.bfloat16, generator=gen)
        expected_sum = x.clone()
        torch.distributed.all_reduce(expected_sum)  # NCCL
        expected_linear = torch.nn.functional.linear(x, w)
        torch.distributed.all_reduce(expected_linear)
        eager_sum = parallel.all_reduce(x.clone())
        eager_linear = parallel.linear_all_reduce(x, w)
        big = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16, generator=gen)  # 2 MiB: over the buffer
        big_expected = big.clone()
        torch.distributed.all_reduce(big_expected)
        big_sum = parallel.all_reduce(big.clone())
        graph = torch.cuda.CUDAGraph()
        static_x = x.clone()
        parallel.linear_all_reduce(static_x, w)  # warm-up outside the capture
        torch.cuda.synchronize()
        torch.distributed.barrier()
        with torch.cuda.graph(graph):
            graph_out = parallel.linear_all_reduce(static_x, w)
        outs = []
        for scale in (1.0, -2.0):
            static_x.copy_(x * scale)
            graph.replay()
            outs.append(graph_out.clone())
        torch.cuda.synchronize()
        results[rank] = dict(
            in_use=in_use,
            sum_err=(eager_sum.float() - expected_sum.float()).abs().max().item(),
            linear_err=(eager_linear.float() - expected_linear.float()).abs().max().item(),
            big_err=(big_sum.float() - big_expected.float()).abs().max().item(),
            graph_err=max((o.float() - s * expected_linear.float()).abs().max().item()
                          for o, s in zip(outs, (1.0, -2.0))),
            scale=expected_linear.float().abs().max().item(),
        )
    finally:
        parallel.destroy_parallel()


def test_symmetric_all_reduce_matches_nccl():
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(free_port(), results), nprocs=2, join=True)
    for rank in (0, 1):
        r = results[rank]
        assert r["in_use"], "symmetric memory should be available between two NVLink GPUs"
        assert r["sum_err"] <= 0.02 and r["big_err"] <= 0.02, r
        # bf16 sums of differently ordered partial products: a few ulps of the result's magnitude
        assert r["linear_err"] <= 0.02 * r["scale"] and r["graph_err"] <= 0.05 * r["scale"], r
