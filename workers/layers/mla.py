"""DeepSeek-V2's multi-head latent attention (MLA) over a latent KV pool, tensor-parallel by heads.

    q       = q_proj(h)  or  q_b_proj(q_a_layernorm(q_a_proj(h)))     [T, H, nope + rope]   (q_lora_rank None / set)
    c, k_pe = kv_a_proj_with_mqa(h) split [L | R];  c = kv_a_layernorm(c)                  one latent a token
    q_pe, k_pe rotated (pairs of adjacent dims, YaRN-scaled); c and k_pe written to the pool (kernels/mla_attention.py)
    q_lat   = q_nope W_UK[h]              [T, H, L]       kv_b_proj's rows [W_UK[h] ; W_UV[h]] per head, folded in
    out_lat = attention over the latents  [T, H, L]
    out     = o_proj(out_lat W_UV[h]^T)   [T, hidden]

Every step, prefill and decode alike, runs in this absorbed form: the pool never holds per-head K or V, and no
step expands the latents (exact reassociation: equal up to rounding to transformers, which expands them).

Tensor parallelism (as vLLM): q_proj / q_b_proj and kv_b_proj split by heads (column-parallel), o_proj
row-parallel; q_a_proj, kv_a_proj_with_mqa and the norms replicated, so every rank computes and stores the same
latents: the latent pool is replicated, its size per rank independent of tp.

Quantization: online FP8 (quantization="fp8" on a float checkpoint) quantizes q_proj / q_b_proj and o_proj; q_a_proj,
kv_a_proj_with_mqa and kv_b_proj stay in the model's dtype. A quantized checkpoint (AWQ, GPTQ, pack-quantized, FP8)
stores every projection quantized: q_a_proj and kv_a_proj_with_mqa are then served as stored, replicated (the whole
packed / FP8 weight on every rank), and kv_b_proj, which the absorbed form reads as the matrices W_UK and W_UV and
never through a linear kernel, is dequantized into the model's dtype once it has loaded (each rank its heads' rows;
as vLLM does).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import ops
from kernels.mla_attention import mla_decode, mla_prefill, write_latent_cache
from workers.layers.attention import AttentionMetadata, KVScaledAttention
from workers.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    _divide,
    dequantize_in_place,
)
from workers.layers.norm import RMSNorm
from workers.layers.quantization import current_quant_config, quantized_layers
from workers.layers.rotary import InterleavedRotaryEmbedding
from workers.models.args import MLAArgs, ModelArgs
from workers.parallel import get_tp_size

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' (and DeepSeek's) default, not rms_norm_eps


def mla_softmax_scale(mla: MLAArgs, rope_scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where the scaling has mscale_all_dim (as
    transformers' and DeepSeek's attention; the rotary cache's own attention factor is mscale / mscale_all_dim)."""
    scale = mla.qk_head_dim ** -0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        factor = float(rope_scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class ReplicatedLinear(ColumnParallelLinear):
    """y = x @ W.T (+ b), the whole W on every rank: a column-parallel layer of one part (in the model's dtype, or
    packed / FP8 as a quantized checkpoint stores it when built inside `quantized_layers`); plus each token's LoRA
    delta where the step has adapters (`lora`: workers/lora.py, the whole A and B on every rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device):
        super().__init__(in_features, out_features, bias, dtype, device, replicated=True)

    def forward(self, x: torch.Tensor, lora_slots: torch.Tensor | None = None,
                lora_order: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, lora_slots=lora_slots, lora_order=lora_order)


def _stored_config():
    """The quantization a checkpoint stores (int, or an FP8 checkpoint's), else None (online FP8 or none)."""
    config = current_quant_config()
    return config if config is not None and (config.is_packed_int or config.is_checkpoint_fp8) else None


class MLAAttention(KVScaledAttention):
    """Attention over one layer's latent pool (latent_cache, rope_cache) in the absorbed form. FP8 pool: k_scale is
    the latents' scale, v_scale the rope keys' (float32 [1] each)."""

    def __init__(self, num_heads: int, scale: float, device=None):
        super().__init__(1, device)
        self.num_heads, self.scale = num_heads, scale

    def forward(self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q_lat [T, H, L], q_pe [T, H, R] -> out_lat [T, H, L]
        latent_scale, rope_scale = self.kv_scales(latent_cache)
        if meta.is_decode_only:
            return mla_decode(q_lat, q_pe, latent_cache, rope_cache, meta.block_tables, meta.seq_lens, self.scale,
                              latent_scale, rope_scale)
        return mla_prefill(q_lat, q_pe, latent_cache, rope_cache, meta.block_tables, meta.query_start_loc,
                           meta.seq_lens, self.scale, meta.max_query_len, latent_scale, rope_scale)

    def compiled(self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                 latent_cache: ops.CacheRef, meta: AttentionMetadata) -> torch.Tensor:
        """`forward` while torch.compile traces the model: this step's latents and rotated keys are written by the
        op that attends (kernels/ops.py `mla_attention`), into the layer's pool, which the graph does not hold."""
        latent_scale, rope_scale = self.kv_scales(latent_cache)
        return ops.mla_attention(q_lat, q_pe, latent, k_pe, latent_cache.layer, meta.slot_mapping,
                                 meta.block_tables, meta.seq_lens,
                                 None if meta.is_decode_only else meta.query_start_loc, self.scale,
                                 meta.max_query_len, latent_scale, rope_scale)


class MLAAttentionBlock(nn.Module):
    """One layer's MLA: projections, rotary, the latent write, attention, o_proj. Checkpoint names as DeepSeek's."""

    takes_quantized_rows = False  # q_a_proj / kv_a_proj_with_mqa read h in the model's dtype

    def __init__(self, args: ModelArgs, dtype, device, rotary_emb: InterleavedRotaryEmbedding):
        super().__init__()
        mla = args.mla
        assert mla is not None, "MLAAttentionBlock needs config.json's kv_lora_rank"
        hidden, bias = args.hidden_size, args.attention_bias
        self.mla, self.dtype = mla, dtype
        self.num_heads = _divide(args.num_heads, get_tp_size(), "num_attention_heads")
        q_rows = args.num_heads * mla.qk_head_dim
        stored = _stored_config()
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_rows, False, dtype, device)
        else:
            with quantized_layers(stored):
                self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias, dtype, device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_rows, False, dtype, device)
        with quantized_layers(stored):
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias,
                                                       dtype, device)
            # dequantized after loading (`finish_loading`): read as W_UK and W_UV, never through a linear kernel
            self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, args.num_heads * (mla.qk_nope_head_dim
                                                                                      + mla.v_head_dim),
                                                  False, dtype, device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj.absorbed_heads = (self.num_heads, mla.qk_nope_head_dim)  # its LoRA slots: LatentLoRAWeights
        self.o_proj = RowParallelLinear(args.num_heads * mla.v_head_dim, hidden, bias, dtype, device)
        self.rotary_emb = rotary_emb  # one cos/sin cache shared by every layer
        self.attn = MLAAttention(self.num_heads, mla_softmax_scale(mla, args.rope_scaling), device)

    def finish_loading(self) -> None:
        """Once the weights have loaded (workers/weights.py): a quantized checkpoint's kv_b_proj as its dequantized
        weight in the model's dtype."""
        if self.kv_b_proj.quant_config is not None:
            dequantize_in_place(self.kv_b_proj, self.dtype)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]) of this rank's heads: views of kv_b_proj's weight."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, :mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim:]

    def forward(self, positions, h, latent_cache, rope_cache, meta: AttentionMetadata) -> torch.Tensor:
        # h: [T, hidden] -> [T, hidden]; meta.lora_slots: each token's adapter (workers/lora.py), kv_b_proj's delta
        # folded in as its weight is
        mla, num_tokens = self.mla, h.shape[0]
        slots, order = meta.lora_slots, meta.lora_order
        if mla.q_lora_rank is None:
            q = self.q_proj(h, lora_slots=slots, lora_order=order)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h, slots, order)), lora_slots=slots, lora_order=order)
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)  # [T, H, nope], [T, H, R]
        latent, k_pe = self.kv_a_proj_with_mqa(h, slots, order).split([mla.kv_lora_rank, mla.qk_rope_head_dim],
                                                                       dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, L]
        q_pe, k_pe = self.rotary_emb(positions, q_pe), self.rotary_emb(positions, k_pe)
        compiling = torch.compiler.is_compiling()  # the pool's tensors are CacheRefs (workers/compile.py)
        if not compiling:  # else the attention op writes them
            write_latent_cache(latent, k_pe, latent_cache, rope_cache, meta.slot_mapping,
                               *self.attn.kv_scales(latent_cache))
        w_uk, w_uv = self.absorbed_weights()
        kv_b_lora = self.kv_b_proj.lora if slots is not None else None
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        if kv_b_lora is not None:
            rows = kv_b_lora.row_slots(slots)
            q_lat = q_lat.contiguous()
            kv_b_lora.absorb_query(q_lat, q_nope, rows)
        if compiling:
            out_lat = self.attn.compiled(q_lat, q_pe, latent, k_pe, latent_cache, meta)
        else:
            out_lat = self.attn(q_lat, q_pe, latent_cache, rope_cache, meta)  # [T, H, L]
        out = torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        if kv_b_lora is not None:
            out = out.contiguous()
            kv_b_lora.absorb_output(out, out_lat, rows)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * mla.v_head_dim), slots, order)
