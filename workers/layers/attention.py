"""Paged attention over the KV pool, for a flat batch of variable-length sequences.

Tokens of all sequences are packed into one dimension T. Sequence b owns tokens
`query_start_loc[b]:query_start_loc[b+1]` of this step; its KV history (including this step's tokens) is
`seq_lens[b]` tokens long, stored in the blocks `block_tables[b]`:

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]   token i of seq b lives in
             block block_tables[b, i // block_size] at offset i % block_size

This step's keys and values are already in the cache (written at `slot_mapping` by the caller, together with the
rotary embedding: slot = block_id * block_size + offset; -1 = skip); every query attends causally to its
sequence's history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops
from kernels.fp8 import FP8_DTYPE
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B], KV length including this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    max_query_len: int
    is_decode_only: bool  # every query length is 1
    lora_slots: torch.Tensor | None = None  # int32 [T]: each token's LoRA slot (-1: base); None: no adapter
    lora_order: torch.Tensor | None = None  # int32 [T]: the rows sorted by slot (the LoRA kernels' tiles), with them


class KVScaledAttention(nn.Module):
    """The attention of one layer over a pool of two tensors per layer (workers/kv_pool.py KVLayout). With a
    float8_e4m3fn pool (kv_cache_dtype="fp8") it holds the layer's scales of the two, float32 [num_kv_heads] powers
    of two (set at load by workers/kv_scales.py), which the KV write and the attention kernels use."""

    def __init__(self, num_kv_heads: int, device=None):
        super().__init__()
        self.register_buffer("k_scale", torch.ones(num_kv_heads, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, device=device), persistent=False)

    def kv_scales(self, k_cache: torch.Tensor | ops.CacheRef) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) for a float8 cache, (None, None) for one in the model's dtype."""
        return (self.k_scale, self.v_scale) if k_cache.dtype == FP8_DTYPE else (None, None)

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        self.k_scale.copy_(k_scale)
        self.v_scale.copy_(v_scale)


class Attention(KVScaledAttention):
    """Paged attention of one layer over per-head K and V. sliding_window W: each query sees only its last W keys
    (itself included); None: its whole history. FP8 KV: per-KV-head scales (`KVScaledAttention`), which the KV write
    (`kv_scales`, passed to `rotate_and_cache`) and the attention kernels use."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, device=None):
        super().__init__(num_kv_heads, device)
        assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, H, D]; caches: [num_blocks, block_size, H_kv, D] holding this step's K/V -> out [T, H * D]
        k_scale, v_scale = self.kv_scales(k_cache)
        if meta.is_decode_only:
            out = paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                         self.sliding_window, k_scale, v_scale)
        else:
            out = paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                          meta.seq_lens, self.scale, meta.max_query_len, self.sliding_window,
                                          k_scale, v_scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def compiled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: ops.CacheRef,
                 meta: AttentionMetadata) -> torch.Tensor:
        """`forward` while torch.compile traces the model: this step's k and v [T, H_kv, D] (rotated) are written
        by the same opaque op that attends (kernels/ops.py `attention`), into the layer's caches, which the graph
        does not hold."""
        k_scale, v_scale = self.kv_scales(k_cache)
        out = ops.attention(q, k, v, k_cache.layer, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                            None if meta.is_decode_only else meta.query_start_loc, self.scale, meta.max_query_len,
                            self.sliding_window, k_scale, v_scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
