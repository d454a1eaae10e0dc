"""Pagoda's own kernels as torch custom ops, for a model compiled by torch.compile (engine/config.py
CompilationConfig, level 3).

Compiled, a decoder layer is one graph: inductor generates the code between these ops (residual adds, RMSNorm, the
per-token FP8 quantization of activations, rotary, SiLU-and-mul where no GEMM fuses it), and each op here is opaque
to it: it runs the same dispatcher as an eager step (the Triton launchers on a GPU, the torch references on CPU) at
the shapes the step has. The layers call them only while dynamo traces (`torch.compiler.is_compiling()`); an eager
step calls the dispatchers directly, without the custom op's cost on the host.

Each op declares what it writes (`mutates_args`) and has a fake implementation (its output's shape and dtype), all
that inductor needs to order the graph around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8 import QuantizedRows, quantize_per_token_ref
from kernels.kv_cache import write_kv_cache as _write_kv_cache
from kernels.linear import linear as _linear
from kernels.linear_fp8 import linear_fp8 as _linear_fp8
from kernels.linear_int import IntPacking
from kernels.linear_int import linear_int as _linear_int
from kernels.lora import lora_expand, lora_shrink
from kernels.mla_attention import mla_decode, mla_prefill, write_latent_cache
from kernels.moe import fused_moe as _fused_moe
from kernels.moe_quant import Fp8Experts, IntExperts, fused_moe_quant
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill


@torch.library.custom_op("pagoda::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """kernels.linear.linear: the decode-sized Triton GEMM (SiLU-and-mul fused when gated), cuBLAS beyond."""
    return _linear(x, weight, bias, gated)


@linear.register_fake
def _(x, weight, bias, gated):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0])


@torch.library.custom_op("pagoda::linear_fp8", mutates_args=())
def _linear_fp8_op(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, gated: bool, block_size: list[int] | None,
                   input_scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """kernels.linear_fp8.linear_fp8 of x (float) or of x quantized per token (x float8 with x_scale [T])."""
    if x_scale is not None:
        x = QuantizedRows(x, x_scale, out_dtype)
    return _linear_fp8(x, weight, weight_scale, bias, gated, tuple(block_size) if block_size else None, input_scale)


@_linear_fp8_op.register_fake
def _(x, x_scale, weight, weight_scale, bias, gated, block_size, input_scale, out_dtype):
    return torch.empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0], dtype=out_dtype,
                       device=x.device)


def linear_fp8(x, weight, weight_scale, bias=None, gated=False, block_size=None, input_scale=None,
               quantize_output=False):
    """kernels.linear_fp8.linear_fp8, traced: the per-token quantization of x (a per-row weight without a static
    input scale) and of a gated output for the next FP8 layer (quantize_output) are torch code that inductor fuses
    with what computes x; the GEMM is the op."""
    if isinstance(x, torch.Tensor) and block_size is None and input_scale is None:
        values, scale = quantize_per_token_ref(x)
        x = QuantizedRows(values, scale, x.dtype)
    if isinstance(x, QuantizedRows):
        out = _linear_fp8_op(x.values, x.scale, weight, weight_scale, bias, gated, None, input_scale, x.dtype)
    else:
        out = _linear_fp8_op(x, None, weight, weight_scale, bias, gated, list(block_size) if block_size else None,
                             input_scale, x.dtype)
    return QuantizedRows.of(out, reference=True) if quantize_output else out


@dataclass(frozen=True)
class CacheRef:
    """What a compiled layer gets in place of a KV cache tensor: the layer's index, as a 0-d int64 host tensor (an
    int would be a constant of the graph, and every layer a graph of its own), and the pool's dtype. The pool is
    never an input of the graph (its tensors are views of one allocation, which inductor would copy to write into);
    `attention` finds the step's pool, which the compiled model's caller sets (`set_kv_caches`)."""

    layer: torch.Tensor
    dtype: torch.dtype


_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the pool of the step being run (set_kv_caches)


def cache_refs(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[CacheRef, CacheRef]]:
    """The CacheRefs of a pool's layers, for a compiled forward."""
    return [(CacheRef(torch.tensor(i), k.dtype), CacheRef(torch.tensor(i), v.dtype))
            for i, (k, v) in enumerate(kv_caches)]


def set_kv_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Makes kv_caches the pool that `attention` reads and writes."""
    global _kv_caches
    _kv_caches = kv_caches


@torch.library.custom_op("pagoda::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, slot_mapping: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None, scale: float,
              max_query_len: int, sliding_window: int | None, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None) -> torch.Tensor:
    """This step's k, v [T, H_kv, D] written into layer `layer`'s KV cache at slot_mapping (-1: skip), then the
    paged attention of q [T, H, D] -> [T, H, D]: decode (query_start_loc None: one query a sequence) or packed
    prefill. One op, as vLLM's: its output depends on the write, so nothing reorders or drops it."""
    k_cache, v_cache = _kv_caches[int(layer)]  # a host tensor: no sync
    _write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if query_start_loc is None:
        return paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                      k_scale, v_scale)
    return paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                   max_query_len, sliding_window, k_scale, v_scale)


@attention.register_fake
def _(q, k, v, layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale, max_query_len, sliding_window,
      k_scale, v_scale):
    return torch.empty_like(q)


@torch.library.custom_op("pagoda::mla_attention", mutates_args=())
def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                  layer: torch.Tensor,
                  slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor | None, scale: float, max_query_len: int,
                  latent_scale: torch.Tensor | None, rope_scale: torch.Tensor | None) -> torch.Tensor:
    """DeepSeek-V2's latent attention as `attention` is: this step's latents [T, L] and rotated keys [T, R] written
    into layer `layer`'s latent pool, then the absorbed attention of q_lat [T, H, L], q_pe [T, H, R] -> [T, H, L]."""
    latent_cache, rope_cache = _kv_caches[int(layer)]
    write_latent_cache(latent, k_pe, latent_cache, rope_cache, slot_mapping, latent_scale, rope_scale)
    if query_start_loc is None:
        return mla_decode(q_lat, q_pe, latent_cache, rope_cache, block_tables, seq_lens, scale, latent_scale,
                          rope_scale)
    return mla_prefill(q_lat, q_pe, latent_cache, rope_cache, block_tables, query_start_loc, seq_lens, scale,
                       max_query_len, latent_scale, rope_scale)


@mla_attention.register_fake
def _(q_lat, q_pe, latent, k_pe, layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale, max_query_len,
      latent_scale, rope_scale):
    return torch.empty_like(q_lat)


@torch.library.custom_op("pagoda::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe.fused_moe: the routed experts of x [T, H] -> [T, H] (this rank's partial sum)."""
    return _fused_moe(x, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


@torch.library.custom_op("pagoda::fused_moe_fp8", mutates_args=())
def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, block_size: list[int] | None, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe_quant.fused_moe_quant over e4m3 experts (scales per row, or per block of block_size)."""
    block = tuple(block_size) if block_size else None
    return fused_moe_quant(x, Fp8Experts(w13, w13_scale, block, parts=2), Fp8Experts(w2, w2_scale, block),
                           topk_weights, topk_ids)


@fused_moe_fp8.register_fake
def _(x, w13, w13_scale, w2, w2_scale, block_size, topk_weights, topk_ids):
    return torch.empty_like(x)


@torch.library.custom_op("pagoda::lora_apply", mutates_args=("out",))
def lora_apply(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               slice_starts: list[int], order: torch.Tensor | None) -> None:
    """out [T, N] += each row's adapter delta: kernels/lora.py's shrink of x by its slot's A, expand by B."""
    lora_expand(out, lora_shrink(x, a, slots, order=order), b, slots, tuple(slice_starts), order=order)


@lora_apply.register_fake
def _(out, x, a, b, slots, slice_starts, order):
    return None


def _packing(bits: int, packed_along_k: bool, fields: list[int] | None, zero_offset: int) -> IntPacking:
    return IntPacking(bits, packed_along_k, tuple(fields) if fields is not None else None, zero_offset)


def packing_args(packing: IntPacking) -> tuple[int, bool, list[int] | None, int]:
    """An IntPacking as custom-op arguments (ops take tensors, numbers and lists, not dataclasses)."""
    return (packing.bits, packing.is_packed_along_k, list(packing.fields) if packing.fields is not None else None,
            packing.zero_offset)


@torch.library.custom_op("pagoda::linear_int", mutates_args=())
def linear_int(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
               g_idx: torch.Tensor | None, group_size: int | None, bits: int, packed_along_k: bool,
               fields: list[int] | None, zero_offset: int, bias: torch.Tensor | None, gated: bool,
               mins: torch.Tensor | None) -> torch.Tensor:
    """kernels.linear_int.linear_int: x @ W.T of packed integer weights (the streaming kernel, or dequantize and
    cuBLAS)."""
    return _linear_int(x, qweight, qzeros, scales, g_idx, group_size,
                       _packing(bits, packed_along_k, fields, zero_offset), bias, gated, mins)


@linear_int.register_fake
def _(x, qweight, qzeros, scales, g_idx, group_size, bits, packed_along_k, fields, zero_offset, bias, gated, mins):
    n = qweight.shape[1] if packed_along_k else qweight.shape[1] * (32 // bits)
    return x.new_empty(x.shape[0], n // 2 if gated else n)


def int_experts_args(experts: IntExperts) -> tuple:
    """One projection's IntExperts as `fused_moe_int`'s arguments: qweight, qzeros, scales, g_idx, mins,
    group_size, then `packing_args`."""
    return (experts.qweight, experts.qzeros, experts.scales, experts.g_idx, experts.mins, experts.group_size,
            *packing_args(experts.packing))


@torch.library.custom_op("pagoda::fused_moe_int", mutates_args=())
def fused_moe_int(x: torch.Tensor, w13_qweight: torch.Tensor, w13_qzeros: torch.Tensor | None,
                  w13_scales: torch.Tensor, w13_g_idx: torch.Tensor | None, w13_mins: torch.Tensor | None,
                  w13_group_size: int | None, w13_bits: int, w13_packed_along_k: bool, w13_fields: list[int] | None,
                  w13_zero_offset: int, w2_qweight: torch.Tensor, w2_qzeros: torch.Tensor | None,
                  w2_scales: torch.Tensor, w2_g_idx: torch.Tensor | None, w2_mins: torch.Tensor | None,
                  w2_group_size: int | None, w2_bits: int, w2_packed_along_k: bool, w2_fields: list[int] | None,
                  w2_zero_offset: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe_quant.fused_moe_quant over packed integer experts (`int_experts_args` of each projection: a
    GGUF file's two may differ)."""
    w13 = IntExperts(w13_qweight, w13_qzeros, w13_scales, w13_g_idx, w13_group_size,
                     _packing(w13_bits, w13_packed_along_k, w13_fields, w13_zero_offset), w13_mins)
    w2 = IntExperts(w2_qweight, w2_qzeros, w2_scales, w2_g_idx, w2_group_size,
                    _packing(w2_bits, w2_packed_along_k, w2_fields, w2_zero_offset), w2_mins)
    return fused_moe_quant(x, w13, w2, topk_weights, topk_ids)


@fused_moe_int.register_fake
def _(x, *args):
    return torch.empty_like(x)
