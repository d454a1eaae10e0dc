"""Rotary embedding: the cache and the reference against transformers' Llama rotary, Triton against the ref."""

import pytest
import torch

from kernels.kv_cache import write_kv_cache_ref
from kernels.rotary import (
    compute_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_and_write_kv,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}
HALF_DIM = 32  # head_dim 64
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 1024,
            "short_factor": [1.0 + 0.05 * i for i in range(HALF_DIM)],
            "long_factor": [1.0 + 0.5 * i for i in range(HALF_DIM)]}
SCALINGS = {"none": None, "linear": {"type": "linear", "factor": 2.0}, "llama3": LLAMA3_SCALING,
            "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
            "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                            "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False},
            "dynamic": {"rope_type": "dynamic", "factor": 2.0},
            "longrope": LONGROPE}
POSITIONS = [0, 1, 2, 255, 256, 1000, 4095]


def hf_rotary(head_dim, max_position, base, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default"} if scaling is None else {**scaling, "rope_type": scaling.get("rope_type",
                                                                                                scaling.get("type"))}
    rope.pop("type", None)
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_position, rope_parameters={**rope, "rope_theta": base})
    return LlamaRotaryEmbedding(config)


def assert_cache_is_hf(cache, cos, sin, positions):
    half = cache.shape[1] // 2
    ours = cache[positions]
    assert torch.equal(ours[:, :half], cos[0, :, :half]) and torch.equal(ours[:, :half], cos[0, :, half:])
    assert torch.equal(ours[:, half:], sin[0, :, :half]) and torch.equal(ours[:, half:], sin[0, :, half:])


@pytest.mark.parametrize("scaling", ["none", "linear", "llama3", "yarn", "yarn_mscale"])
def test_cache_is_transformers_cos_sin(scaling):
    head_dim, max_position, base = 64, 4096, 500000.0
    cache = compute_cos_sin_cache(head_dim, max_position, base, SCALINGS[scaling])
    positions = torch.tensor([POSITIONS])
    cos, sin = hf_rotary(head_dim, max_position, base, SCALINGS[scaling])(torch.zeros(1, dtype=torch.float32),
                                                                          positions)
    assert_cache_is_hf(cache, cos, sin, positions[0])
    if scaling.startswith("yarn"):
        assert cache[0, 0] != 1.0  # cos(0) times the attention factor


@pytest.mark.parametrize("max_model_len", [2048, 4096, 6000])
def test_dynamic_ntk_is_transformers_at_max_model_len(max_model_len):
    """transformers rescales dynamic NTK in each forward pass from its longest position: ours, fixed from
    max_model_len, equals its result for a pass whose longest position is max_model_len - 1 (none up to
    max_position_embeddings)."""
    head_dim, mpe, base = 64, 4096, 10000.0
    scaling = SCALINGS["dynamic"]
    cache = compute_cos_sin_cache(head_dim, max_model_len, base, scaling, max_position_embeddings=mpe,
                                  max_model_len=max_model_len)
    positions = torch.tensor([[0, 1, 77, 2047, max_model_len - 1]])
    cos, sin = hf_rotary(head_dim, mpe, base, scaling)(torch.zeros(1), positions)
    assert_cache_is_hf(cache, cos, sin, positions[0])
    plain = compute_cos_sin_cache(head_dim, max_model_len, base)
    assert torch.equal(cache, plain) == (max_model_len <= mpe)


@pytest.mark.parametrize("max_model_len", [1024, 4096])
def test_longrope_factors_chosen_by_max_model_len(max_model_len):
    """Short factors while max_model_len fits the original context, long ones beyond: transformers' choice for any
    pass of at most `original` positions, and for any pass longer than that."""
    head_dim, mpe, base = 64, 4096, 10000.0
    cache = compute_cos_sin_cache(head_dim, max_model_len, base, LONGROPE, max_position_embeddings=mpe,
                                  max_model_len=max_model_len)
    positions = torch.tensor([[0, 5, 700, max_model_len - 1]])
    cos, sin = hf_rotary(head_dim, mpe, base, LONGROPE)(torch.zeros(1), positions)
    assert_cache_is_hf(cache, cos, sin, positions[0])
    assert cache[0, 0] > 1.0  # cos(0) times the attention factor, sqrt(1 + ln 4 / ln 1024), with either factors
    short = compute_cos_sin_cache(head_dim, 1024, base, LONGROPE, max_position_embeddings=mpe, max_model_len=1024)
    assert torch.equal(cache[:1024], short) == (max_model_len <= 1024)


def test_unknown_scaling_raises():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'mrope'"):
        compute_cos_sin_cache(64, 16, 10000.0, {"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ValueError, match="long_factor / short_factor must have head_dim / 2 = 16"):
        compute_cos_sin_cache(32, 16, 10000.0, LONGROPE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ref_is_transformers_apply_rotary_pos_emb(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim, num_tokens = 64, 9
    rotary = hf_rotary(head_dim, 512, 10000.0, None)
    cache = compute_cos_sin_cache(head_dim, 512, 10000.0)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, 4, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, 2, head_dim, generator=gen).to(dtype)
    cos, sin = rotary(q, positions[None])  # cast to q's dtype by transformers
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_flat = q.flatten(1).clone()  # the model's layout: [T, heads * head_dim]
    rotary_embedding_ref(positions, q_flat, k, cache, head_dim)
    assert torch.equal(q_flat.unflatten(1, (4, head_dim)), q_hf[0].transpose(0, 1))
    assert torch.equal(k, k_hf[0].transpose(0, 1))


# fp16: the interpreter's casts round like torch's, so one ulp at most; bf16: it truncates (see rms_norm's test).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (3e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 32), (6, 3, 80)])
@pytest.mark.parametrize("scaling", ["none", "llama3"])
def test_triton_matches_ref(dtype, num_heads, num_kv_heads, head_dim, scaling, device):
    cache = compute_cos_sin_cache(head_dim, 1024, 10000.0, SCALINGS[scaling]).to(device)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 1024, (11,), generator=gen).to(device)
    q = torch.randn(11, num_heads * head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(11, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_triton(positions, q, k, cache, head_dim)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_dim)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, k_ref, atol=atol, rtol=rtol)


def test_triton_in_place_on_fused_qkv_views(device):
    """q and k as strided views into one qkv output; v (between them in memory) must stay untouched."""
    head_dim = 32
    cache = compute_cos_sin_cache(head_dim, 64, 10000.0).to(device)
    qkv = torch.randn(5, (4 + 2 + 2) * head_dim, device=device)
    before = qkv.clone()
    positions = torch.tensor([0, 3, 63, 7, 7], device=device)
    q, k = qkv[:, : 4 * head_dim], qkv[:, 4 * head_dim : 6 * head_dim]
    rotary_embedding_triton(positions, q, k, cache, head_dim)
    ref = before.clone()
    rotary_embedding_ref(positions, ref[:, : 4 * head_dim], ref[:, 4 * head_dim : 6 * head_dim], cache, head_dim)
    torch.testing.assert_close(qkv, ref)
    assert torch.equal(qkv[:, 6 * head_dim :], before[:, 6 * head_dim :])
    assert torch.equal(qkv[0], before[0])  # position 0: the identity
    with pytest.raises(ValueError, match="k must be"):
        rotary_embedding_triton(positions, q, k[:, :40], cache, head_dim)


def _fused_case(device, dtype, num_heads, num_kv_heads, head_dim, block_size, num_tokens, gen):
    """Inputs of `rotary_embedding_and_write_kv`: a fused qkv output (q, k, v are views of it), NaN-poisoned caches,
    shuffled distinct slots with two padding tokens."""
    cache = compute_cos_sin_cache(head_dim, 512, 10000.0, LLAMA3_SCALING).to(device)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(device)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    num_blocks = 2 * num_tokens // block_size + 2
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
              for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, -1]] = -1
    return positions, qkv, cache, caches, slots.to(device)


def _split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 4, 64, 16), (8, 2, 32, 1), (6, 3, 80, 4)])
def test_fused_rotary_and_kv_write_matches_the_two_refs(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                        device):
    gen = torch.Generator().manual_seed(2)
    positions, qkv, cos_sin, (k_cache, v_cache), slots = _fused_case(
        device, dtype, num_heads, num_kv_heads, head_dim, block_size, 9, gen)
    ref_qkv, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    rotary_embedding_triton(positions, q, k, cos_sin, head_dim, (v, k_cache, v_cache, slots))
    rq, rk, rv = _split_qkv(ref_qkv, num_heads, num_kv_heads, head_dim)
    rotary_embedding_ref(positions, rq, rk, cos_sin, head_dim)
    write_kv_cache_ref(rk.unflatten(1, (num_kv_heads, head_dim)), rv.unflatten(1, (num_kv_heads, head_dim)),
                       ref_k_cache, ref_v_cache, slots)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv, ref_qkv, atol=atol, rtol=rtol)
    # Written slots match; every other slot is still NaN (padding tokens wrote nothing).
    torch.testing.assert_close(k_cache, ref_k_cache, atol=atol, rtol=rtol, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v_cache, atol=0, rtol=0, equal_nan=True)
    assert k_cache.isnan().any(dim=(2, 3)).sum() == k_cache.shape[0] * block_size - (slots >= 0).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 4, 64, 16), (8, 2, 32, 1), (6, 3, 80, 4)])
def test_head_norms_fused_match_the_unfused_layer(dtype, num_heads, num_kv_heads, head_dim, block_size, device):
    """qk_norm (Qwen3): each head of q and k RMSNorm-ed inside the rotary kernel, in place in the fused qkv rows,
    against the layer's unfused way (rms_norm of the [T * heads, head_dim] copies, then rotary and the KV write):
    to the dtype's rounding (the two sum the squares in other orders)."""
    from kernels.rms_norm import rms_norm_ref

    gen = torch.Generator().manual_seed(4)
    positions, qkv, cos_sin, (k_cache, v_cache), slots = _fused_case(
        device, dtype, num_heads, num_kv_heads, head_dim, block_size, 9, gen)
    weights = [(1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2)]
    ref_qkv, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    rotary_embedding_triton(positions, q, k, cos_sin, head_dim, (v, k_cache, v_cache, slots), (*weights, 1e-6))
    rq, rk, rv = _split_qkv(ref_qkv, num_heads, num_kv_heads, head_dim)
    rq = rms_norm_ref(rq.reshape(-1, head_dim), weights[0], 1e-6).view(rq.shape)
    rk = rms_norm_ref(rk.reshape(-1, head_dim), weights[1], 1e-6).view(rk.shape)
    rotary_embedding_ref(positions, rq, rk, cos_sin, head_dim)
    write_kv_cache_ref(rk.unflatten(1, (num_kv_heads, head_dim)), rv.unflatten(1, (num_kv_heads, head_dim)),
                       ref_k_cache, ref_v_cache, slots)
    atol, rtol = TOL[dtype]
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    torch.testing.assert_close(qkv[:, :q_dim], rq, atol=2 * atol, rtol=2 * rtol)
    torch.testing.assert_close(qkv[:, q_dim:q_dim + kv_dim], rk, atol=2 * atol, rtol=2 * rtol)
    assert torch.equal(qkv[:, q_dim + kv_dim:], ref_qkv[:, q_dim + kv_dim:])  # v untouched
    torch.testing.assert_close(k_cache, ref_k_cache, atol=2 * atol, rtol=2 * rtol, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v_cache, atol=0, rtol=0, equal_nan=True)


def test_head_norms_on_cpu_are_the_layers_norms_then_the_refs():
    """On CPU the public function norms each head with rms_norm_ref and rotates with the reference: bit for bit
    the layer's unfused way (the transformers oracle's numbers)."""
    from kernels.rms_norm import rms_norm_ref

    gen = torch.Generator().manual_seed(5)
    positions, qkv, cos_sin, (k_cache, v_cache), slots = _fused_case("cpu", torch.bfloat16, 4, 2, 16, 4, 6, gen)
    weights = [(1 + 0.5 * torch.randn(16, generator=gen)).to(torch.bfloat16) for _ in range(2)]
    ref_qkv = qkv.clone()
    q, k, v = _split_qkv(qkv, 4, 2, 16)
    rotary_embedding_and_write_kv(positions, q, k, v, cos_sin, 16, k_cache, v_cache, slots, qk_norm=(*weights, 1e-6))
    rq, rk, _ = _split_qkv(ref_qkv, 4, 2, 16)
    rq = rms_norm_ref(rq.reshape(-1, 16), weights[0], 1e-6).view(rq.shape)
    rk = rms_norm_ref(rk.reshape(-1, 16), weights[1], 1e-6).view(rk.shape)
    rotary_embedding_ref(positions, rq, rk, cos_sin, 16)
    assert torch.equal(qkv[:, :64], rq) and torch.equal(qkv[:, 64:96], rk)


def test_fused_public_function_on_cpu_is_the_two_refs():
    gen = torch.Generator().manual_seed(3)
    positions, qkv, cos_sin, (k_cache, v_cache), slots = _fused_case("cpu", torch.float32, 4, 2, 16, 4, 6, gen)
    ref_qkv, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_embedding_and_write_kv(positions, *_split_qkv(qkv, 4, 2, 16)[:2], _split_qkv(qkv, 4, 2, 16)[2], cos_sin,
                                  16, k_cache, v_cache, slots)
    rq, rk, rv = _split_qkv(ref_qkv, 4, 2, 16)
    rotary_embedding_ref(positions, rq, rk, cos_sin, 16)
    write_kv_cache_ref(rk.unflatten(1, (2, 16)), rv.unflatten(1, (2, 16)), ref_k_cache, ref_v_cache, slots)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(k_cache.nan_to_num(), ref_k_cache.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), ref_v_cache.nan_to_num())


def test_public_function_on_cpu_is_the_reference():
    cache = compute_cos_sin_cache(16, 32, 10000.0)
    positions = torch.arange(4)
    q, k = torch.randn(4, 32), torch.randn(4, 16)
    q2, k2 = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, 16)
    rotary_embedding_ref(positions, q2, k2, cache, 16)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.gpu
def test_gpu_llama3_8b_sizes(cuda):
    cache = compute_cos_sin_cache(128, 131072, 500000.0, {**LLAMA3_SCALING, "original_max_position_embeddings": 8192})
    cache = cache.to(cuda)
    positions = torch.randint(0, 131072, (4096,), device=cuda)
    q = torch.randn(4096, 32 * 128, device=cuda, dtype=torch.bfloat16)
    k = torch.randn(4096, 8 * 128, device=cuda, dtype=torch.bfloat16)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, 128)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, 128)
    # The kernel rotates in float32 and rounds once; the reference rounds after each bf16 op as transformers
    # does, so about a fifth of the elements differ in the last bit: compare with bf16's tolerance.
    torch.testing.assert_close(q, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k, k_ref, atol=1e-2, rtol=1e-2)
