"""The decode benchmark's floor (`read_only` in benchmarks/kernels.py): one launch that must read every element of
both caches once, or the floor it reports would be too fast."""

import pytest
import torch

from benchmarks.kernels import read_only


@pytest.mark.parametrize("blocks, programs", [(3, 8), (5, 16), (40, 1024)])
@pytest.mark.parametrize("one_allocation", [True, False])
def test_read_only_reads_both_caches_once(blocks, programs, one_allocation, device):
    shape = (blocks, 16, 2, 64)

    def cache(*lead):  # whole numbers 1-7: every sum below is exact, so one element missed or read twice shows
        return torch.randint(1, 8, (*lead, *shape), device=device).float()

    if one_allocation:  # v after k in one tensor
        k_cache, v_cache = cache(2).unbind(0)
    else:  # separate tensors: v may lie before k in memory
        v_cache, k_cache = cache(), cache()
    sums = torch.full((programs,), float("nan"), device=device)
    read_only(k_cache, v_cache, sums)
    assert not sums.isnan().any()  # every program wrote its sum
    assert sums.double().sum().item() == k_cache.double().sum().item() + v_cache.double().sum().item()
