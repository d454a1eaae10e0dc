"""The paged KV pool of one rank: a (K, V) pair of tensors per layer, and how many blocks fit in memory; and the
host-memory tier behind it (`HostKVPool`), in the same layout and dtype.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads_per_rank, head_dim]   (one pair per layer)
"""

from __future__ import annotations

import weakref

import torch

from engine.config import CacheConfig
from workers.inputs import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class KVMoveError(RuntimeError):
    """A step's KV move (offload, copy-on-write, onload) failed: what the pools hold is no longer what the driver's
    books say, so the executor can run no more steps (fatal), unlike a failed forward."""


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    element_bytes = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> KVCaches:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


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

        buffer [num_layers, 2, num_host_blocks, block_size, num_kv_heads_per_rank, head_dim]   one allocation
        caches[layer] = (buffer[layer, 0], buffer[layer, 1])                                     K, V

    Copies move raw words, batched per layer (an index_select and an index_copy_ per tensor, whatever the number of
    blocks): bit-exact for any dtype.

    On CUDA the buffer is page-locked with cudaHostRegister, not torch's pinned allocator (that one rounds every
    allocation up to a power of two: 40 GiB asked would pin 64), and the device reads and writes it in place
    through its unified address (UVA, as vLLM's and SGLang's CPU tiers do): no staging memory, no per-block copy.
      offload  on a copy stream of its own, after the compute stream's work so far (which wrote those blocks); an
               event recorded after it is what `wait_for_offloads` makes the compute stream wait on, before a later
               write to those device blocks. The step that issued it does not wait (unless it writes them itself).
      onload   on the compute stream: the forward that reads the blocks is queued after the copy, and an offload of
               a later step (the copy stream first waits for the compute stream) cannot overwrite a host block while
               an onload still reads it. It adds the copy to the step's time, once, for a prefix that would
               otherwise be prefilled.
    On CPU both tiers are host memory and every copy is done when the call returns.
    """

    def __init__(self, device_caches: KVCaches, num_blocks: int):
        k_cache = device_caches[0][0]
        self.device = k_cache.device
        self.num_blocks = num_blocks
        self.buffer = torch.empty((len(device_caches), 2, num_blocks, *k_cache.shape[1:]), dtype=k_cache.dtype)
        self.caches: KVCaches = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(len(device_caches))]
        self.is_pinned = self.device.type == "cuda"
        on_device = self.buffer
        self._copy_stream = None
        self._offloaded: torch.cuda.Event | None = None  # recorded after the offloads not yet waited for
        if self.is_pinned:
            on_device = _register(self.buffer, self.device)
            self._copy_stream = torch.cuda.Stream(self.device)
        self._device_rows = [(_rows(k), _rows(v)) for k, v in device_caches]
        self._host_rows = [(_rows(on_device[i, 0]), _rows(on_device[i, 1])) for i in range(len(device_caches))]

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block): the host block becomes a copy of the device block, in every layer."""
        if not pairs:
            return
        if self._copy_stream is None:
            self._copy(pairs, to_host=True)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):  # its index tensors and temporaries belong to the copy stream
            self._copy(pairs, to_host=True)
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
        if pairs:
            self._copy([(d, h) for h, d in pairs], to_host=False)

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """pairs: (device block, host block); one index_select and one index_copy_ per tensor."""
        device_ids = to_device([d for d, _ in pairs], torch.long, self.device)
        host_ids = to_device([h for _, h in pairs], torch.long, self.device)
        for device_kv, host_kv in zip(self._device_rows, self._host_rows):
            for dev, host in zip(device_kv, host_kv):
                if to_host:
                    host.index_copy_(0, host_ids, dev.index_select(0, device_ids))
                else:
                    dev.index_copy_(0, device_ids, host.index_select(0, host_ids))


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, ...] as one row of raw words per block (the widest word that divides a block): a copy moves
    bits whatever the dtype, and a wide word moves more of them per thread over PCIe."""
    row_bytes = cache[0].numel() * cache.element_size()
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % w.itemsize == 0)
    return cache.view(cache.shape[0], -1).view(word)


class _CudaArray:
    """The CUDA array interface of registered host memory: with UVA its host address is its device address."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # keeps the memory alive while a CUDA view of it lives
        self.__cuda_array_interface__ = {"shape": (tensor.numel() * tensor.element_size(),), "typestr": "|u1",
                                         "data": (tensor.data_ptr(), False), "version": 3, "strides": None}


def _register(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-locks `buffer` (exactly its size) and returns a CUDA tensor over the same memory; the memory is
    unregistered when the buffer goes (after the device's work on it)."""
    num_bytes = buffer.numel() * buffer.element_size()
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        # cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, mapped into the device's
        # address space (under UVA at the host address itself)
        error = cudart.cudaHostRegister(buffer.data_ptr(), num_bytes, 3)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {num_bytes / 2**30:.2f} GiB for the host KV tier failed "
                               f"({error}): lower swap_space (the host tier's GiB per rank)")
        view = torch.as_tensor(_CudaArray(buffer), device=device)
    assert view.is_cuda and view.data_ptr() == buffer.data_ptr(), "the host tier's CUDA view is a copy, not a view"
    weakref.finalize(buffer, _unregister, buffer.data_ptr(), device).atexit = False  # at exit the process goes
    return view.view(buffer.dtype).view(buffer.shape)


def _unregister(address: int, device: torch.device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(address)
