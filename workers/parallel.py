"""Tensor-parallel state of this process: its rank, the group size, and the collectives the layers use.

One process = one TP rank (one Ray worker actor = one GPU). The state is module-level because a process belongs to
exactly one tensor-parallel group for its whole life; `init_parallel` sets it once, `destroy_parallel` clears it.
Without `init_parallel` the process is rank 0 of a group of 1 and every collective is a no-op, so single-device code
and tests need no set-up.

`set_parallel_state_for_testing(rank, world_size)` pretends to be one rank of a larger group without a process
group: enough to build layers and load their weight shards (no collective may run then).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank: int = 0
_world_size: int = 1
_owns_process_group: bool = False  # True when init_parallel created the torch.distributed group


def init_parallel(rank: int, world_size: int, backend: str = "gloo", init_method: str | None = None) -> None:
    """Joins the tensor-parallel group. `backend`: "nccl" on GPUs, "gloo" on CPU; `init_method` e.g. "tcp://h:p"."""
    global _rank, _world_size, _owns_process_group
    assert 0 <= rank < world_size, f"rank {rank} out of range for world_size {world_size}"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
        _owns_process_group = True
    _rank, _world_size = rank, world_size


def destroy_parallel() -> None:
    """Leaves the group (if this module created it) and returns to rank 0 of 1."""
    global _rank, _world_size, _owns_process_group
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _rank, _world_size, _owns_process_group = 0, 1, False


def set_parallel_state_for_testing(rank: int, world_size: int) -> None:
    """Test hook: acts as `rank` of `world_size` with no process group (weight sharding only, no collectives)."""
    global _rank, _world_size
    assert 0 <= rank < world_size, f"rank {rank} out of range for world_size {world_size}"
    _rank, _world_size = rank, world_size


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the ranks, in place; returns it."""
    if _world_size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's `x` (same shape on all ranks) along `dim`, on every rank."""
    if _world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenates every rank's `x` along `dim` on rank 0; other ranks get None."""
    if _world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_world_size)] if _rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if _rank == 0 else None


def broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Overwrites `t` on every rank with rank 0's `t`, in place; returns it."""
    if _world_size == 1:
        return t
    dist.broadcast(t, src=0)
    return t
