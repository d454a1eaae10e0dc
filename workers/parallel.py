"""Tensor-parallel state of this process: its rank, the group size, and the collectives the layers use.

One process = one TP rank (one Ray worker actor = one GPU). The state is module-level because a process belongs to
exactly one tensor-parallel group for its whole life; `init_parallel` sets it once, `destroy_parallel` clears it.
Without `init_parallel` the process is rank 0 of a group of 1 and every collective is a no-op, so single-device code
and tests need no set-up.

`set_parallel_state_for_testing(rank, world_size)` pretends to be one rank of a larger group without a process
group: enough to build layers and load their weight shards (no collective may run then).

On GPUs joined by NVLink, `init_symmetric_all_reduce` sets up torch's symmetric memory: small all-reduces (every
decode step's) then run as one-shot kernels that read the peers' buffers over NVLink (about 14 us for two H200s,
against 33-57 us for NCCL), and row-parallel matmuls write straight into the symmetric buffer. Larger tensors,
and machines where it cannot be set up, use NCCL. NVLink multicast is never used.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from engine import envs
from kernels.linear import linear

logger = logging.getLogger(__name__)

_rank: int = 0
_world_size: int = 1
_owns_process_group: bool = False  # True when init_parallel created the torch.distributed group
_symm: SymmetricAllReduce | None = None


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
    global _rank, _world_size, _owns_process_group, _symm
    _symm = None
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


class SymmetricAllReduce:
    """One-shot all-reduce over a torch symmetric-memory buffer of `max_bytes` (NVLink peer loads, no multicast)."""

    def __init__(self, max_bytes: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if self.handle is None:
            raise RuntimeError("symmetric memory rendezvous failed")

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype == self.dtype and numel <= self.max_numel

    def staging(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the symmetric buffer to compute the tensor to reduce in."""
        return self.buffer[:math.prod(shape)].view(shape)

    def reduce(self, staged: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of their `staged` tensors (views from `staging`), as a new tensor."""
        out = torch.empty_like(staged)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged.view(-1), "sum", self.group_name, out.view(-1))
        return out


def init_symmetric_all_reduce(dtype: torch.dtype, device: torch.device, max_bytes: int = 8 << 20) -> bool:
    """Sets up the symmetric-memory all-reduce on every rank (collective: all ranks call it). Returns whether it
    is in use; when it cannot be (no NVLink peer access, ranks that do not see each other's GPUs), NCCL stays."""
    global _symm
    if _world_size == 1 or device.type != "cuda" or not envs.get("PAGODA_SYMM_MEM"):
        return False
    try:
        candidate = SymmetricAllReduce(max_bytes, dtype, device)
        ok = True
    except Exception as e:  # noqa: BLE001 - any failure means NCCL, on every rank (agreed below)
        logger.warning("symmetric-memory all-reduce unavailable, using NCCL: %s", e)
        candidate, ok = None, False
    agreed = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    _symm = candidate if agreed.item() == 1 else None
    return _symm is not None


def all_reduce_backend() -> str:
    """How this rank's all-reduces run: "none" (one rank), "symmetric-memory (<= N MiB) + nccl", or the
    process group's backend."""
    if _world_size == 1:
        return "none"
    backend = dist.get_backend() if dist.is_initialized() else "none"
    if _symm is not None:
        return f"symmetric-memory (<= {_symm.max_numel * _symm.buffer.element_size() >> 20} MiB) + {backend}"
    return backend


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the ranks; returns the sum (in place with NCCL, a new tensor with symmetric memory; a new
    tensor too while torch.compile traces the model: the custom op `_all_reduce_op`)."""
    if _world_size == 1:
        return x
    if torch.compiler.is_compiling():
        return _all_reduce_op(x)
    if _symm is not None and _symm.fits(x.numel(), x.dtype):
        staged = _symm.staging(tuple(x.shape))
        staged.copy_(x)
        return _symm.reduce(staged)
    dist.all_reduce(x)
    return x


@torch.library.custom_op("pagoda::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks as an op that inductor cannot see into, in a tensor of its own (never the symmetric
    buffer, which the next all-reduce overwrites while the graph may still hold it)."""
    out = x.clone()
    dist.all_reduce(out)
    return out


@_all_reduce_op.register_fake
def _(x):
    return torch.empty_like(x)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of `x` over the ranks, in place."""
    if _world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` summed over the ranks (a row-parallel layer); the matmul writes into the symmetric buffer
    when the result fits, so the all-reduce needs no copy."""
    if _world_size > 1 and _symm is not None and x.dim() == 2 and _symm.fits(x.shape[0] * weight.shape[0], x.dtype):
        staged = _symm.staging((x.shape[0], weight.shape[0]))
        torch.matmul(x, weight.t(), out=staged)
        return _symm.reduce(staged)
    return all_reduce(linear(x, weight))


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
