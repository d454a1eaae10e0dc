"""The paged KV pool of one rank: a pair of tensors per layer in the model's `KVLayout`, and how many blocks fit in
memory; and the host-memory tier behind it (`HostKVPool`), in the same layout and dtype.

    per-head K and V (every family but DeepSeek)      latent (DeepSeek's multi-head latent attention, MLA)
    k_cache [num_blocks, block_size, H_kv, D]         latent_cache [num_blocks, block_size, 1, kv_lora_rank]
    v_cache [num_blocks, block_size, H_kv, D]         rope_cache   [num_blocks, block_size, 1, qk_rope_head_dim]

A latent pool stores per token and layer the compressed KV c_kv (which every head's key and value are projected
from) and the one rotated key k_pe that every head shares: 512 + 64 values for DeepSeek-V2, the same on every
tensor-parallel rank (replicated, as vLLM does), against 2 x H_kv x D per rank for per-head K and V. The code that
moves, copies, sizes and calibrates blocks sees only "a pair of tensors per layer" and the layout's shapes.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from engine.config import CacheConfig
from workers.inputs import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class KVMoveError(RuntimeError):
    """A step's KV move (offload, copy-on-write, onload) failed: what the pools hold is no longer what the driver's
    books say, so the executor can run no more steps (fatal), unlike a failed forward."""


@dataclass(frozen=True)
class KVLayout:
    """What one rank's pool holds for one token of one layer: two tensors of `num_heads` x `head_dims[i]` values
    (per-head K and V: the KV heads of this rank; latent: one "head", the latent and the rope key). The model gives
    it (`model.kv_layout`); the pool's allocation, its sizing and the host tier read it."""

    num_layers: int
    num_heads: int
    head_dims: tuple[int, int]
    is_latent: bool = False

    @classmethod
    def per_head(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayout:
        return cls(num_layers, num_kv_heads, (head_dim, head_dim))

    @classmethod
    def latent(cls, num_layers: int, kv_lora_rank: int, rope_dim: int) -> KVLayout:
        return cls(num_layers, 1, (kv_lora_rank, rope_dim), is_latent=True)

    def shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one layer's two tensors."""
        first, second = self.head_dims
        return ((num_blocks, block_size, self.num_heads, first), (num_blocks, block_size, self.num_heads, second))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Every layer's bytes for one token."""
        return self.num_layers * self.num_heads * sum(self.head_dims) * torch.tensor([], dtype=dtype).element_size()

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)


def allocate_kv_caches(layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> KVCaches:
    """The pool in as few allocations as the layout allows, each [num_layers, k, num_blocks, block_size, heads, dim]:
    one with k = 2 whose [layer, 0] / [layer, 1] are the layers' K and V when the two tensors of a layer have one
    shape (per-head), else one with k = 1 per tensor (a latent pool's latents and rope keys). A move of blocks
    between tiers gathers every layer's rows of an allocation in one kernel."""
    first, second = layout.shapes(num_blocks, block_size)
    if first == second:
        buffer = torch.zeros((layout.num_layers, 2, *first), dtype=dtype, device=device)
        return [(buffer[i, 0], buffer[i, 1]) for i in range(layout.num_layers)]
    firsts = torch.zeros((layout.num_layers, 1, *first), dtype=dtype, device=device)
    seconds = torch.zeros((layout.num_layers, 1, *second), dtype=dtype, device=device)
    return [(firsts[i, 0], seconds[i, 0]) for i in range(layout.num_layers)]


def kv_buffers(caches: KVCaches) -> list[torch.Tensor]:
    """The allocations behind caches from `allocate_kv_caches`, each [num_layers, k, num_blocks, ...]: the one of
    both tensors (k = 2), or the first tensors' and the second tensors' (k = 1 each)."""
    first, second = caches[0]
    if first._base is not None and first._base is second._base:
        groups = [[t for kv in caches for t in kv]]
    else:
        groups = [[k for k, _ in caches], [v for _, v in caches]]
    bases = [group[0]._base for group in groups]
    for base, group in zip(bases, groups):
        if base is None or base.dim() != 6 or base.shape[:2] != (len(caches), len(group) // len(caches)) or \
                any(t._base is not base for t in group):
            raise ValueError("the KV caches are not the allocations of allocate_kv_caches")
    return bases


def num_blocks_cpu(cap_bytes: int, block_bytes: int) -> int:
    """On CPU the pool gets a fixed memory cap (CacheConfig.cpu_kv_cache_bytes)."""
    return max(cap_bytes // block_bytes, 1)


def num_blocks_gpu(device: torch.device, gpu_memory_utilization: float, block_bytes: int) -> int:
    """After a profiling forward at the largest batch: the blocks that fit in utilization * total memory, minus
    what is in use now (weights, other processes, the CUDA context) and the activations' peak."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    available = int(total * gpu_memory_utilization) - in_use - activation_peak
    if available < block_bytes:
        raise RuntimeError(f"no memory left for the KV cache: {available / 2**30:.2f} GiB available after the model "
                           f"({in_use / 2**30:.2f} GiB in use of {total / 2**30:.2f} GiB); raise "
                           f"gpu_memory_utilization or use a smaller model")
    return available // block_bytes


def copy_blocks(kv_caches: KVCaches, copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: block dst becomes a copy of block src in every layer."""
    if not copies:
        return
    device = kv_caches[0][0].device
    src = to_device([s for s, _ in copies], torch.long, device)
    dst = to_device([d for _, d in copies], torch.long, device)
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


# ---- the host tier ---------------------------------------------------------------------------------------------
def num_host_blocks(cache: CacheConfig, block_bytes: int) -> int:
    """The host tier's blocks on one rank: `num_host_kv_blocks` when set, else what `swap_space_gib` holds."""
    if cache.num_host_kv_blocks is not None:
        return cache.num_host_kv_blocks
    return int(cache.swap_space_gib * 2**30) // block_bytes


class HostKVPool:
    """The host-memory KV tier of one rank: blocks in the device pool's layout and dtype (FP8 KV: its e4m3 bytes;
    the per-head scales are global and stay with the model), moved by block pairs that the driver picks.

        buffer [num_host_blocks, num_layers, a layer's first tensor of a block + its second]   one allocation
        caches[layer] = (first [num_host_blocks, *first.shape[1:]], second [...])                views of it

    (per-head K and V, or a latent pool's latents and rope keys: the two tensors of a layer may differ in shape.)
    Block-major, unlike the device pool (layer-major, `allocate_kv_caches`): a host block, every layer's pair of it,
    is one contiguous run of bytes, so a move is one gather (or scatter) kernel on the device per device allocation
    (one per-head, two latent), between the device pool and a staging tensor in the host block layout, and one copy
    per run of consecutive host blocks between that staging tensor and host memory. Raw words: bit-exact for any
    dtype.

    On CUDA the buffer is page-locked with cudaHostRegister, not torch's pinned allocator (that one rounds every
    allocation up to a power of two: 40 GiB asked would pin 64): the
    copies are cudaMemcpyAsync between device memory and it, done by the copy engines (no SM is held waiting on
    PCIe, as a kernel writing host memory through its mapped address would be; vLLM's swap copies likewise).
      offload  on a copy stream of its own, after the compute stream's work so far (which wrote those blocks); an
               event recorded after it is what `wait_for_offloads` makes the compute stream wait on, before a later
               write to those device blocks. The step that issued it does not wait (unless it writes them itself).
      onload   on the compute stream: the forward that reads the blocks is queued after the copy, and an offload of
               a later step (the copy stream first waits for the compute stream) cannot overwrite a host block while
               an onload still reads it. It adds the copy to the step's time, once, for a prefix that would
               otherwise be prefilled.
    Staging tensors are allocated on the stream that uses them, so the caching allocator reuses their memory only
    after that stream's copies. On CPU both tiers are host memory and every copy is done when the call returns.
    """

    def __init__(self, device_caches: KVCaches, num_blocks: int):
        device_buffers = kv_buffers(device_caches)
        self.device = device_buffers[0].device
        self.num_blocks = num_blocks
        first, second = device_caches[0]
        num_layers, first_size = len(device_caches), first[0].numel()
        self.buffer = torch.empty((num_blocks, num_layers, first_size + second[0].numel()), dtype=first.dtype)
        self.caches: KVCaches = [(self.buffer[:, i, :first_size].view(num_blocks, *first.shape[1:]),
                                  self.buffer[:, i, first_size:].view(num_blocks, *second.shape[1:]))
                                 for i in range(num_layers)]
        self.is_pinned = self.device.type == "cuda"
        self._copy_stream = None
        self._offloaded: torch.cuda.Event | None = None  # recorded after the offloads not yet waited for
        if self.is_pinned:
            _register(self.buffer, self.device)
            self._copy_stream = torch.cuda.Stream(self.device)
        rows = [b.flatten(3) for b in device_buffers]  # [L, k, N, a layer's tensor of a block]
        word = _widest_word(math.gcd(*(r.shape[-1] * r.element_size() for r in rows)))  # divides a host block too
        self._device_rows = [r.view(torch.uint8).view(word) for r in rows]
        self._host_blocks = self.buffer.view(num_blocks, -1).view(torch.uint8).view(word)  # [Nh, words of a block]

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block): the host block becomes a copy of the device block, in every layer."""
        if not pairs:
            return
        if self._copy_stream is None:
            self._to_host(pairs)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):  # its index tensors and staging belong to the copy stream
            self._to_host(pairs)
        self._offloaded = torch.cuda.Event()
        self._offloaded.record(self._copy_stream)

    @property
    def is_offloading(self) -> bool:
        """Offloads are in flight that the compute stream does not wait for yet (CUDA only)."""
        return self._offloaded is not None

    def wait_for_offloads(self) -> None:
        """The compute stream's later work (what overwrites an offloaded device block) waits for the offloads."""
        if self._offloaded is not None:
            torch.cuda.current_stream(self.device).wait_event(self._offloaded)
            self._offloaded = None

    def onload(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block): the device block becomes a copy of the host block, on the compute stream."""
        if not pairs:
            return
        staging = torch.empty((len(pairs), self._host_blocks.shape[1]), dtype=self._host_blocks.dtype,
                              device=self.device)
        for start, (first, count) in _runs([h for h, _ in pairs]):
            staging[start:start + count].copy_(self._host_blocks[first:first + count], non_blocking=True)
        device_ids = to_device([d for _, d in pairs], torch.long, self.device)
        for rows, part in zip(self._device_rows, self._parts(staging)):
            rows.index_copy_(2, device_ids, part.permute(1, 2, 0, 3))  # [L, k, n, words], layer-major

    def _to_host(self, pairs: list[tuple[int, int]]) -> None:
        device_ids = to_device([d for d, _ in pairs], torch.long, self.device)
        staging = torch.empty((len(pairs), self._host_blocks.shape[1]), dtype=self._host_blocks.dtype,
                              device=self.device)  # host block layout
        for rows, part in zip(self._device_rows, self._parts(staging)):
            part.copy_(rows.index_select(2, device_ids).permute(2, 0, 1, 3))  # [n, L, k, words]
        for start, (first, count) in _runs([h for _, h in pairs]):
            self._host_blocks[first:first + count].copy_(staging[start:start + count], non_blocking=True)

    def _parts(self, staging: torch.Tensor) -> list[torch.Tensor]:
        """staging [n, words of a host block] as each device allocation's part of it, [n, L, k, words]."""
        blocks = staging.view(staging.shape[0], len(self.caches), -1)
        parts, offset = [], 0
        for rows in self._device_rows:
            num_layers, k, _, words = rows.shape
            parts.append(blocks[:, :, offset:offset + k * words].view(-1, num_layers, k, words))
            offset += k * words
        return parts


def _runs(ids: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """(position in ids, (first id, count)) for each run of consecutive ids: one copy each."""
    runs: list[tuple[int, tuple[int, int]]] = []
    for position, block in enumerate(ids):
        if runs and block == runs[-1][1][0] + runs[-1][1][1]:
            runs[-1] = (runs[-1][0], (runs[-1][1][0], runs[-1][1][1] + 1))
        else:
            runs.append((position, (block, 1)))
    return runs


def _widest_word(num_bytes: int) -> torch.dtype:
    """The widest integer type that divides num_bytes: a copy moves raw bits whatever the dtype, wide words more of
    them per thread."""
    return next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if num_bytes % w.itemsize == 0)


def _register(buffer: torch.Tensor, device: torch.device) -> None:
    """Page-locks `buffer` (exactly its size), so that copies to and from it are asynchronous DMA; the memory is
    unregistered when the buffer goes (after the device's work on it)."""
    num_bytes = buffer.numel() * buffer.element_size()
    with torch.cuda.device(device):
        # cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, mapped into the device's
        # address space
        error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), num_bytes, 3)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {num_bytes / 2**30:.2f} GiB for the host KV tier failed "
                           f"({error}): lower swap_space (the host tier's GiB per rank)")
    weakref.finalize(buffer, _unregister, buffer.data_ptr(), device).atexit = False  # at exit the process goes


def _unregister(address: int, device: torch.device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(address)
