"""The decode benchmark's floor (`read_only` in benchmarks/kernels.py): one launch that must read every element of
both caches once, or the floor it reports would be too fast."""

import pytest
import torch

from benchmarks.kernels import read_only


@pytest.mark.parametrize("blocks, programs", [(3, 8), (5, 16), (40, 1024)])
@pytest.mark.parametrize("one_allocation", [True, False])
def test_read_only_reads_both_caches_once(blocks, programs, one_allocation, device):
    shape = (blocks, 16, 2, 64)
    if one_allocation:  # v after k in one tensor
        k_cache, v_cache = torch.randn(2, *shape, device=device).unbind(0)
    else:  # separate tensors: v may lie before k in memory
        v_cache, k_cache = torch.randn(shape, device=device), torch.randn(shape, device=device)
    k_cache[0, 0, 0, 0], v_cache[-1, -1, -1, -1] = 1e4, -3e3  # first and last elements count
    sums = torch.full((programs,), float("nan"), device=device)
    read_only(k_cache, v_cache, sums)
    assert not sums.isnan().any()  # every program wrote its sum
    expected = k_cache.double().sum() + v_cache.double().sum()
    assert sums.double().sum().item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-3)
