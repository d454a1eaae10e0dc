"""Pagoda's own kernels as torch custom ops, for a model compiled by torch.compile (engine/config.py
CompilationConfig, level 3).

Compiled, a forward pass is one graph: inductor generates the code between these ops (residual adds, RMSNorm, the
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
    out_dtype = x.dtype
    if isinstance(x, torch.Tensor) and block_size is None and input_scale is None:
        values, scale = quantize_per_token_ref(x)
        x = QuantizedRows(values, scale, x.dtype)
    if isinstance(x, QuantizedRows):
        out = _linear_fp8_op(x.values, x.scale, weight, weight_scale, bias, gated, None, input_scale, x.dtype)
    else:
        out = _linear_fp8_op(x, None, weight, weight_scale, bias, gated, list(block_size) if block_size else None,
                             input_scale, out_dtype)
    return QuantizedRows.of(out, reference=True) if quantize_output else out


@dataclass(frozen=True)
class CacheRef:
    """What a compiled forward's layers get in place of a KV cache tensor: the layer's index and the pool's dtype.
    The pool is never an input of the graph (its tensors are views of one allocation, which inductor would copy
    to write into); `attention` finds the step's pool, which the compiled model's caller sets (`set_kv_caches`)."""

    layer: int
    dtype: torch.dtype


_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the pool of the step being run (set_kv_caches)


def set_kv_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[CacheRef, CacheRef]]:
    """Makes kv_caches the pool that `attention` reads and writes; returns their CacheRefs, for the forward."""
    global _kv_caches
    _kv_caches = kv_caches
    return [(CacheRef(i, k.dtype), CacheRef(i, v.dtype)) for i, (k, v) in enumerate(kv_caches)]


@torch.library.custom_op("pagoda::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None, scale: float,
              max_query_len: int, sliding_window: int | None, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None) -> torch.Tensor:
    """This step's k, v [T, H_kv, D] written into layer `layer`'s KV cache at slot_mapping (-1: skip), then the
    paged attention of q [T, H, D] -> [T, H, D]: decode (query_start_loc None: one query a sequence) or packed
    prefill. One op, as vLLM's: its output depends on the write, so nothing reorders or drops it."""
    k_cache, v_cache = _kv_caches[layer]
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
