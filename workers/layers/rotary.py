"""Rotary position embedding (neox style: the two halves of each head are rotated as pairs)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.rotary import compute_cos_sin_cache, rotary_embedding, rotary_embedding_and_write_kv


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin cache for positions [0, max_position) and rotates q and k in place.

    The cache is computed in float32 and stored in the model dtype, as Hugging Face casts cos and sin to the
    activations' dtype before applying them.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 dtype=torch.float32, device=None, max_position_embeddings: int | None = None,
                 max_model_len: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        # max_position_embeddings (the checkpoint's) and max_model_len fix the length-dependent scalings
        # (kernels/rope_scaling.py); both default to max_position.
        cache = compute_cos_sin_cache(head_dim, max_position, base, rope_scaling,
                                      max_position_embeddings=max_position_embeddings,
                                      max_model_len=max_model_len)  # [max_position, head_dim]
        self.register_buffer("cos_sin_cache", cache.to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, H_kv, D]; rotated in place and returned
        rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)
        return q, k

    def rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
        """Rotates q and k in place and writes the rotated k and v at `slot_mapping` (one kernel on a GPU); a
        float8 cache takes the layer's scales (`Attention.kv_scales`); qk_norm=(q weight, k weight, eps): each
        head RMSNorm-ed first, in the same kernel."""
        rotary_embedding_and_write_kv(positions, q, k, v, self.cos_sin_cache, self.head_dim, k_cache, v_cache,
                                      slot_mapping, k_scale, v_scale, qk_norm)


class InterleavedRotaryEmbedding(nn.Module):
    """RoPE over adjacent pairs (x[2i], x[2i+1]) rotated by position * inv_freq[i] (GPT-J style, "not neox"), as
    DeepSeek-V2 rotates its qk_rope_head_dim dims: transformers multiplies them as complex numbers in float32 by
    cos + i sin (times the scaling's attention factor) and rounds once, and so does this. The cache stays float32
    [max_position, head_dim]: cos in the first half of each row, sin in the second (`compute_cos_sin_cache`)."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None, device=None,
                 max_position_embeddings: int | None = None, max_model_len: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        cache = compute_cos_sin_cache(head_dim, max_position, base, rope_scaling,
                                      max_position_embeddings=max_position_embeddings, max_model_len=max_model_len)
        self.register_buffer("cos_sin_cache", cache.to(device=device), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, ..., head_dim] (any strides) -> rotated, a new tensor in x's dtype
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, head_dim / 2] float32 each
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        pairs = x.float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)
