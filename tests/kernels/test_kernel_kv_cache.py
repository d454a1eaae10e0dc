"""write_kv_cache: the Triton scatter against the torch reference, and the reference against a plain loop."""

import pytest
import torch

from kernels.kv_cache import write_kv_cache, write_kv_cache_ref, write_kv_cache_triton


def make_case(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, dtype, device, num_skipped=2, seed=0):
    """Random k, v, NaN-filled caches and a slot mapping of distinct slots with `num_skipped` -1 entries."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_skipped]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    return k, v, k_cache, k_cache.clone(), slots.to(device)


def test_ref_matches_a_plain_loop():
    k, v, k_cache, v_cache, slots = make_case(20, 2, 8, 6, 4, torch.float32, "cpu")
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 4, slot % 4], k[t])
            assert torch.equal(v_cache[slot // 4, slot % 4], v[t])
    written = (slots >= 0).sum().item()
    assert (~k_cache.isnan()).all(-1).all(-1).sum().item() == written  # nothing else touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 32), (3, 80)])  # also non-powers of two
def test_triton_matches_ref(dtype, block_size, num_kv_heads, head_dim, device):
    k, v, k_cache, v_cache, slots = make_case(37, num_kv_heads, head_dim, 64 // block_size + 3, block_size,
                                              dtype, device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, ref_k, ref_v, slots)
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    # equal_nan: skipped tokens and unused slots must stay NaN, bit for bit.
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


def test_triton_strided_views_of_fused_qkv(device):
    """k and v as the model makes them: [T, H, D] views into one qkv output, int32 slots, all -1 but one."""
    qkv = torch.randn(9, (4 + 2 + 2) * 16, device=device)
    k = qkv[:, 64:96].unflatten(1, (2, 16))
    v = qkv[:, 96:].unflatten(1, (2, 16))
    k_cache = torch.full((3, 16, 2, 16), float("nan"), device=device)
    v_cache = k_cache.clone()
    slots = torch.full((9,), -1, dtype=torch.int32, device=device)
    slots[4] = 40
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 8], k[4]) and torch.equal(v_cache[2, 8], v[4])
    assert k_cache.isnan().sum() == k_cache.numel() - 32


def test_empty_batch_and_bad_inputs(device):
    k, v, k_cache, v_cache, slots = make_case(4, 2, 16, 2, 4, torch.float32, device, num_skipped=0)
    write_kv_cache_triton(k[:0], v[:0], k_cache, v_cache, slots[:0])
    assert k_cache.isnan().all()
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv_cache_triton(k, v, k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match="dtype"):
        write_kv_cache_triton(k, v, k_cache.half(), v_cache.half(), slots)
    with pytest.raises(ValueError, match="heads/head_dim"):
        write_kv_cache_triton(k[:, :1], v[:, :1], k_cache, v_cache, slots)


def test_public_function_on_cpu_is_the_reference():
    k, v, k_cache, v_cache, slots = make_case(10, 1, 16, 4, 4, torch.float16, "cpu")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots)
    write_kv_cache_ref(k, v, ref_k, ref_v, slots)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
def test_gpu_write_llama3_8b(cuda):
    """A 16k-token prefill into a 2k-block pool: 8 KV heads of 128, block 16, bf16."""
    k, v, k_cache, v_cache, slots = make_case(16384, 8, 128, 2048, 16, torch.bfloat16, cuda, num_skipped=100)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, ref_k, ref_v, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)
