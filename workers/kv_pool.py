"""The paged KV pool of one rank: a (K, V) pair of tensors per layer, and how many blocks fit in memory.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads_per_rank, head_dim]   (one pair per layer)
"""

from __future__ import annotations

import torch

from workers.inputs import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


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
