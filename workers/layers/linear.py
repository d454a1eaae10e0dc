"""Tensor-parallel linear layers (Megatron style) with per-parameter weight loaders.

Weights keep the Hugging Face layout `[out_features, in_features]`.

    ColumnParallelLinear   W split by rows (output features): each rank computes its slice of the output.
    RowParallelLinear      W split by columns (input features): each rank takes its slice of the input and the
                           partial outputs are summed with an all-reduce; the bias is added once, after the sum.

Each parameter carries `weight_loader(param, loaded, shard_id=None)`. `loaded` is a safetensors slice
(`safe_open(...).get_slice(name)`) or a tensor; a loader indexes only this rank's part of it (`loaded[a:b]`,
`loaded[:, a:b]`), so a rank never reads the whole checkpoint tensor.

With LoRA (workers/lora.py) a layer also holds `lora`, its adapters' stacked slots, and a forward given
`lora_slots` (each token's slot, -1: none) adds each token's adapter delta to its output: a column-parallel layer
holds its output rows of B (A whole), a row-parallel one its input columns of A (B whole) and adds its partial
delta before the all-reduce, which sums it as it sums the partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization import QuantConfig
from kernels import ops
from kernels.activation import silu_and_mul
from kernels.fp8 import QuantizedRows, dequantize_weight
from kernels.linear import linear
from kernels.linear_fp8 import linear_fp8
from kernels.linear_int import dequantize_ref
from workers.layers.quantization import Shard, create_fp8_weights, current_quant_config, quantized_layers
from workers.layers.quantization_int import create_int_weights, finish_int_weights, linear_int
from workers.parallel import all_reduce, get_tp_rank, get_tp_size, linear_all_reduce


def loaded_shape(loaded) -> tuple[int, ...]:
    """Shape of a safetensors slice or a tensor."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def copy_loaded(dst: torch.Tensor, src) -> None:
    """Copies an already-indexed slice (tensor) into `dst`, checking the shape."""
    src = src if isinstance(src, torch.Tensor) else src[:]
    assert tuple(dst.shape) == tuple(src.shape), (
        f"shape mismatch: parameter {tuple(dst.shape)}, loaded {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    """Replicated parameter (norm weights, row-parallel bias): copies the whole tensor."""
    assert shard_id is None, f"unexpected shard_id {shard_id!r} for a replicated parameter"
    assert loaded_shape(loaded) == tuple(param.shape), (
        f"shape mismatch: parameter {tuple(param.shape)}, loaded {loaded_shape(loaded)}")
    copy_loaded(param.data, loaded)


def _divide(n: int, d: int, what: str) -> int:
    assert n % d == 0, f"{what} ({n}) is not divisible by tensor_parallel_size ({d})"
    return n // d


def _param(shape: tuple[int, ...], dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


class ColumnParallelLinear(nn.Module):
    """y[:, rank's slice] = x @ W[rank's rows].T (+ b[rank's slice]). The output stays split across ranks.

    Built inside `quantized_layers(config)` (workers/layers/quantization.py), the weight is FP8 with scales, or
    an AWQ / GPTQ checkpoint's packed integers (workers/layers/quantization_int.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32, device=None,
                 replicated: bool = False):
        super().__init__()
        # replicated: the whole W on every rank (one part: workers/layers/mla.py's ReplicatedLinear)
        self.tp_rank, self.tp_size = (0, 1) if replicated else (get_tp_rank(), get_tp_size())
        self.in_features = in_features
        self.out_features_per_rank = _divide(out_features, self.tp_size, "out_features")
        _make_weight(self, self.out_features_per_rank, in_features, dtype, device, is_k_split=False)
        self.bias = _param((self.out_features_per_rank,), dtype, device, self.weight_loader) if bias else None
        self.lora = None  # workers/lora.py LoRAWeights, with enable_lora

    def shard(self, shard_id=None) -> Shard:
        """This rank's part of a checkpoint tensor (see `Shard`)."""
        assert shard_id is None, f"ColumnParallelLinear takes no shard_id, got {shard_id!r}"
        n = self.out_features_per_rank
        return Shard(slice(0, n), slice(self.tp_rank * n, (self.tp_rank + 1) * n))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        shard = self.shard(shard_id)
        copy_loaded(param.data[shard.dst], loaded[shard.src_rows] if param.dim() == 1 else shard.index(loaded))

    def finish_loading(self) -> None:
        finish_weight(self)

    @property
    def takes_quantized_rows(self) -> bool:
        return takes_quantized_rows(self)

    def forward(self, x: torch.Tensor | QuantizedRows, gated: bool = False, quantize_output: bool = False,
                lora_slots: torch.Tensor | None = None, lora_order: torch.Tensor | None = None):
        # x: [T, in] -> [T, out / tp]; gated: SiLU-and-mul of a [gate ; up] output -> [T, out / (2 tp)], as
        # QuantizedRows with quantize_output (for an FP8 layer after that takes_quantized_rows); lora_slots: int32
        # [T], each token's adapter slot (None: no adapter in the step); lora_order: int32 [T], the rows sorted by
        # slot (optional: the kernels then tile the sorted rows)
        if lora_slots is None or self.lora is None:
            return self._forward(x, gated, quantize_output)
        assert isinstance(x, torch.Tensor), "a layer with LoRA slots takes no quantized rows"
        # the adapters add to the [gate ; up] output before the SiLU-and-mul
        out = self.lora.apply(lambda: self._forward(x, False, False), x, lora_slots, lora_order)
        return silu_and_mul(out, quantize_output) if gated else out

    def _forward(self, x: torch.Tensor | QuantizedRows, gated: bool, quantize_output: bool):
        return matmul(self, x, self.bias, gated, quantize_output)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_proj and up_proj: `output_sizes=[I, I]`).

    Each rank's weight is [gate rows of this rank ; up rows of this rank]; `shard_id` is the index in output_sizes.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=torch.float32,
                 device=None):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, dtype, device)
        self.sizes_per_rank = [_divide(s, self.tp_size, "output size") for s in self.output_sizes]

    def shard(self, shard_id=None) -> Shard:
        assert isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes), f"bad shard_id {shard_id!r}"
        offset, n = sum(self.sizes_per_rank[:shard_id]), self.sizes_per_rank[shard_id]
        return Shard(slice(offset, offset + n), slice(self.tp_rank * n, (self.tp_rank + 1) * n))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        assert isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes), f"bad shard_id {shard_id!r}"
        assert loaded_shape(loaded)[0] == self.output_sizes[shard_id], (
            f"shard {shard_id}: expected {self.output_sizes[shard_id]} rows, loaded {loaded_shape(loaded)}")
        super().weight_loader(param, loaded, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; attention heads split across ranks.

    Each rank's weight is [its q heads ; its k heads ; its v heads] (rows of head_dim each). When there are fewer
    KV heads than ranks, KV heads are replicated: rank r holds KV head `r * num_kv_heads // tp_size`, the one its
    query heads use.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype=torch.float32, device=None):
        tp_size = get_tp_size()
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads_per_rank = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads_per_rank = _divide(num_kv_heads, tp_size, "num_key_value_heads")
        else:
            assert tp_size % num_kv_heads == 0, (
                f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads ({num_kv_heads})")
            self.num_kv_heads_per_rank = 1
        out = (self.num_heads_per_rank + 2 * self.num_kv_heads_per_rank) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, dtype, device)

    @property
    def q_size(self) -> int:  # per rank
        return self.num_heads_per_rank * self.head_dim

    @property
    def kv_size(self) -> int:  # per rank
        return self.num_kv_heads_per_rank * self.head_dim

    def _kv_head_start(self) -> int:
        if self.num_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads_per_rank
        return self.tp_rank * self.num_kv_heads // self.tp_size

    def shard(self, shard_id=None) -> Shard:
        d = self.head_dim
        if shard_id == "q":
            offset, rows, start_head = 0, self.q_size, self.tp_rank * self.num_heads_per_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            rows, start_head = self.kv_size, self._kv_head_start()
        else:
            raise AssertionError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return Shard(slice(offset, offset + rows), slice(start_head * d, start_head * d + rows))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        total_heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        assert loaded_shape(loaded)[0] == total_heads * self.head_dim, (
            f"{shard_id}: expected {total_heads * self.head_dim} rows, loaded {loaded_shape(loaded)}")
        super().weight_loader(param, loaded, shard_id)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv: [T, q_size + 2 * kv_size] -> q [T, q_size], k [T, kv_size], v [T, kv_size]
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x[:, rank's slice] @ W[:, rank's columns].T) + b. The input arrives already split.

    reduce_results=False returns this rank's partial sum (no bias then): the caller adds it to other partials and
    all-reduces once (an MoE block's shared expert and routed experts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32, device=None,
                 reduce_results: bool = True):
        super().__init__()
        assert reduce_results or not bias, "a partial sum cannot take the bias: reduce_results=False needs bias=False"
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.in_features_per_rank = _divide(in_features, self.tp_size, "in_features")
        self.out_features = out_features
        _make_weight(self, out_features, self.in_features_per_rank, dtype, device, is_k_split=True)
        self.bias = _param((out_features,), dtype, device, default_weight_loader) if bias else None
        self.lora = None  # workers/lora.py LoRAWeights, with enable_lora

    def shard(self, shard_id=None) -> Shard:
        assert shard_id is None, f"RowParallelLinear takes no shard_id, got {shard_id!r}"
        n = self.in_features_per_rank
        return Shard(slice(None), slice(None), slice(self.tp_rank * n, (self.tp_rank + 1) * n))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        copy_loaded(param.data, self.shard(shard_id).index(loaded))

    def finish_loading(self) -> None:
        finish_weight(self)

    @property
    def takes_quantized_rows(self) -> bool:
        return takes_quantized_rows(self)

    def forward(self, x: torch.Tensor | QuantizedRows, lora_slots: torch.Tensor | None = None,
                lora_order: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in / tp] -> [T, out]; lora_slots: int32 [T], each token's adapter slot (None: no adapter in the step);
        # lora_order: as ColumnParallelLinear's
        if lora_slots is not None and self.lora is not None:
            return self._forward_lora(x, lora_slots, lora_order)
        if not self.reduce_results:
            return matmul(self, x, None)
        if self.quant_config is None and not torch.compiler.is_compiling():
            y = linear_all_reduce(x, self.weight)  # the matmul writes into the all-reduce's buffer
        else:
            y = all_reduce(matmul(self, x, None))
        return y + self.bias if self.bias is not None else y

    def _forward_lora(self, x: torch.Tensor | QuantizedRows, lora_slots: torch.Tensor,
                      lora_order: torch.Tensor | None) -> torch.Tensor:
        """This rank's partial output plus its partial adapter delta (its input columns of A), then the all-reduce:
        both are linear in x's columns, so the sum over ranks is the whole delta."""
        assert isinstance(x, torch.Tensor), "a layer with LoRA slots takes no quantized rows"
        y = self.lora.apply(lambda: matmul(self, x, None), x, lora_slots, lora_order)
        if not self.reduce_results:
            return y
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y


def matmul(layer: nn.Module, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None, gated: bool = False,
           quantize_output: bool = False):
    """The layer's x @ W.T (+ bias) by its weight's kind: packed integers, FP8 (quantize_output: a gated output as
    QuantizedRows for the FP8 layer after it) or the model dtype. While torch.compile traces the model, Pagoda's
    GEMMs are opaque custom ops (kernels/ops.py) and the quantization around them is inductor's code."""
    compiling = torch.compiler.is_compiling()
    if layer.quant_config is not None and layer.quant_config.is_packed_int:
        assert not quantize_output, "only an FP8 layer quantizes its output"
        if layer.input_perm is not None:  # act-order sorted at load: W's input features in this order
            x = x[:, layer.input_perm]
        if compiling:
            return ops.linear_int(x, layer.qweight, layer.qzeros, layer.scales,
                                  layer.g_idx if layer.quant_config.desc_act else None, layer.group_size,
                                  *ops.packing_args(layer.packing), bias, gated, layer.mins)
        return linear_int(layer, x, bias, gated)
    if layer.quant_config is not None:
        return (ops.linear_fp8 if compiling else linear_fp8)(x, layer.weight, layer.weight_scale, bias, gated,
                                                             layer.block_size, layer.input_scale, quantize_output)
    assert not quantize_output, "only an FP8 layer quantizes its output"
    return (ops.linear if compiling else linear)(x, layer.weight, bias, gated)


def takes_quantized_rows(layer: nn.Module) -> bool:
    """FP8 weights with per-row scales and per-token activations: the kernel before the layer (an RMSNorm, a
    SiLU-and-mul) may hand it its input quantized (kernels/fp8.py `QuantizedRows`) instead of the layer quantizing
    it in a pass of its own."""
    config = layer.quant_config
    return (config is not None and not config.is_packed_int and layer.block_size is None
            and layer.input_scale is None and layer.lora is None)  # adapters read the input in the model dtype


def finish_weight(layer: nn.Module) -> None:
    """What a Column- or RowParallelLinear makes of its loaded weight (workers/weights.py calls it once every
    tensor has loaded): int layers' layout for the kernels (`finish_int_weights`)."""
    if layer.quant_config is not None and layer.quant_config.is_packed_int:
        finish_int_weights(layer)


def _make_weight(layer: nn.Module, rows: int, cols: int, dtype, device, is_k_split: bool) -> None:
    """The layer's weight: FP8 with scales, or packed integers (AWQ, GPTQ), when built inside
    `quantized_layers`, else `dtype`."""
    layer.quant_config = current_quant_config()
    if layer.quant_config is not None and layer.quant_config.is_packed_int:
        create_int_weights(layer, rows, cols, device, layer.quant_config, is_k_split)
    elif layer.quant_config is not None:
        create_fp8_weights(layer, rows, cols, device, layer.quant_config)
    else:
        layer.weight = _param((rows, cols), dtype, device, layer.weight_loader)


_WEIGHT_TENSORS = ("weight", "qweight", "qzeros", "scales", "g_idx", "mins", "input_perm", "weight_scale",
                   "input_scale")


def remake_weight(layer: nn.Module, config: QuantConfig | None, dtype) -> None:
    """Rebuilds a Column- or RowParallelLinear's weight for `config` (None: unquantized, in `dtype`) in place of
    the one it was built with, before loading: a GGUF file's linears each take what their own type allows."""
    device = next(p.device for p in layer.parameters(recurse=False))
    for name in _WEIGHT_TENSORS:
        if name in layer._parameters or name in layer._buffers or name in layer.__dict__:  # also a plain None
            delattr(layer, name)
    is_k_split = isinstance(layer, RowParallelLinear)
    rows, cols = ((layer.out_features, layer.in_features_per_rank) if is_k_split
                  else (layer.out_features_per_rank, layer.in_features))
    with quantized_layers(config):
        _make_weight(layer, rows, cols, dtype, device, is_k_split)


@torch.no_grad()
def dequantize_in_place(layer: nn.Module, dtype) -> None:
    """A loaded quantized Column- or RowParallelLinear as a plain weight of this rank's dequantized values in `dtype`
    (a layer read as a matrix, not through a linear kernel: MLA's kv_b_proj, workers/layers/mla.py)."""
    config = layer.quant_config
    if config.is_packed_int:
        w = dequantize_ref(layer.qweight, layer.qzeros, layer.scales, layer.g_idx if config.desc_act else None,
                           layer.group_size, layer.packing, torch.float32, layer.mins)
        if layer.input_perm is not None:  # W's input features back in the checkpoint's order
            w = torch.empty_like(w).index_copy_(1, layer.input_perm, w)
    else:
        w = dequantize_weight(layer.weight, layer.weight_scale, layer.block_size)
    remake_weight(layer, None, dtype)
    layer.weight.data.copy_(w)
