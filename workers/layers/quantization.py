"""FP8 linear layers: what a quantized tensor-parallel linear layer holds, how its shards load, how it runs.

The scheme is a property of the linear layers, not of a model file: `load_model` builds the model inside
`quantized_layers(quant_config)`, and every ColumnParallel / MergedColumn / QKV / RowParallel linear made there is
FP8 (the embedding and the LM head are not). Such a layer holds

    weight         float8_e4m3fn [N_rank, K_rank]
    weight_scale   float32 [N_rank] per output row, or [N_rank / bn, K_rank / bk] per block (block checkpoints)
    input_scale    float32 [1], a power of two (static-activation checkpoints only; else per token at run time)

Loading (each rank reads only its slice, as the unquantized loaders do; `Shard` says which):
- a bf16 / fp16 / fp32 checkpoint (online, `quantization="fp8"`): the rank quantizes each slice as it arrives,
  one scale per output row of the slice (`kernels.fp8.quantize_weight`); a row-parallel layer's rows are its
  K slice, so its scales are those of its shard (tp 1 and tp 2 quantize o_proj and down_proj differently);
- an FP8 checkpoint: weights copied, scales sliced like the weight's rows (per-tensor scales of fused
  q / k / v or gate / up become per-row scales: exact); block scales slice by whole blocks only;
  static input scales: the largest of the fused parts' (same input), rounded up to a power of two.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from engine.quantization import QuantConfig
from kernels.fp8 import FP8_DTYPE, pow2_ceil, quantize_weight, quantize_weight_blocks

_current: QuantConfig | None = None
RANDOM_CHUNK_ELEMENTS = 1 << 26  # random FP8 weights are drawn this many elements at a time (no bf16 copy)


@contextlib.contextmanager
def quantized_layers(config: QuantConfig | None):
    """Linear layers built inside are FP8 per `config` (None: unquantized)."""
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def current_quant_config() -> QuantConfig | None:
    return _current


@dataclass(frozen=True)
class Shard:
    """Where a checkpoint tensor's part goes: local weight rows `dst` take checkpoint rows `src_rows`, columns
    `src_cols` (None: all)."""

    dst: slice
    src_rows: slice
    src_cols: slice | None = None

    def index(self, loaded):
        return loaded[self.src_rows] if self.src_cols is None else loaded[self.src_rows, self.src_cols]


def _param(shape, dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


def create_fp8_weights(layer: nn.Module, rows: int, cols: int, device, config: QuantConfig) -> None:
    """Gives `layer` (which has `shard(shard_id) -> Shard`) the FP8 parameters and their loaders."""
    layer.quant_config = config
    layer.block_size = config.block_size if config.weight == "block" else None
    layer.weight = _param((rows, cols), FP8_DTYPE, device, lambda p, loaded, shard_id=None:
                          _load_weight(layer, loaded, shard_id))
    layer.weight.random_init = lambda std, generator: _random_weight(layer, std, generator)
    if layer.block_size is None:
        scale_shape = (rows,)
    else:
        scale_shape = (-(-rows // layer.block_size[0]), -(-cols // layer.block_size[1]))
    if config.is_checkpoint_fp8:
        layer.weight_scale = _param(scale_shape, torch.float32, device, lambda p, loaded, shard_id=None:
                                    _load_scale(layer, loaded, shard_id))
        layer.weight_scale.random_init = lambda std, generator: None  # set with the weight
    else:
        layer.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
    layer.input_scale = static_input_scale(device) if config.activation == "static" else None


def static_input_scale(device) -> nn.Parameter:
    """A static-activation checkpoint's input scale, float32 [1]: its loader keeps the largest of the values it is
    given (a fused layer's parts, a layer's experts), each rounded up to a power of two; 1.0 with random weights."""
    scale = _param((1,), torch.float32, device, _keep_largest_pow2)
    scale.data.zero_()
    scale.random_init = lambda std, generator: scale.data.fill_(1.0)
    return scale


def _keep_largest_pow2(param: nn.Parameter, loaded, shard_id=None) -> None:
    value = pow2_ceil(loaded[...].float().reshape(1)).to(param.device)
    param.data.copy_(torch.maximum(param.data, value))


def _load_weight(layer, loaded, shard_id) -> None:
    shard = layer.shard(shard_id)
    part = shard.index(loaded)
    dst = layer.weight.data[shard.dst]
    if layer.quant_config.is_checkpoint_fp8:
        if part.dtype != FP8_DTYPE:
            raise ValueError(f"an FP8 checkpoint's weight must be float8_e4m3fn, got {part.dtype} "
                             f"(shape {tuple(part.shape)})")
        _copy(dst, part)
        return
    weight_q, scale = quantize_weight(part.to(dst.device))  # online: this rank's rows of its slice
    _copy(dst, weight_q)
    layer.weight_scale.data[shard.dst].copy_(scale)


def _load_scale(layer, loaded, shard_id) -> None:
    shard = layer.shard(shard_id)
    dst = layer.weight_scale.data
    numel = 1
    for d in (loaded.shape if isinstance(loaded, torch.Tensor) else loaded.get_shape()):
        numel *= d
    if numel == 1:  # one scale for the whole (part of a fused) tensor: every row of it
        value = loaded[...].float().reshape(())
        if layer.block_size is None:
            dst[shard.dst] = value
        else:
            dst[_blocks(shard.dst, layer.block_size[0], "rows")] = value
        return
    if layer.block_size is None:  # [N, 1] or [N] per row
        _copy(dst[shard.dst], loaded[shard.src_rows].float().reshape(-1))
        return
    bn, bk = layer.block_size
    rows = _blocks(shard.src_rows, bn, "rows")
    part = loaded[rows] if shard.src_cols is None else loaded[rows, _blocks(shard.src_cols, bk, "columns")]
    _copy(dst[_blocks(shard.dst, bn, "rows")], part.float())


def _blocks(s: slice, block: int, what: str) -> slice:
    """The scale blocks of a weight slice that starts on a block boundary (and ends on one, or at the end)."""
    if s.start is None and s.stop is None:
        return s
    if s.start % block:
        raise ValueError(f"weight_block_size {block}: this rank's {what} start at {s.start}, inside a scale block; "
                         "use a tensor_parallel_size whose shards cover whole blocks")
    return slice(s.start // block, -(-s.stop // block))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    assert tuple(dst.shape) == tuple(src.shape), f"shape mismatch: parameter {tuple(dst.shape)}, loaded " \
                                                 f"{tuple(src.shape)}"
    dst.copy_(src)


@torch.no_grad()
def _random_weight(layer, std: float, generator: torch.Generator) -> None:
    """N(0, std) weights drawn in chunks of rows on the device and quantized there: never a full-precision copy
    of the layer (a 70B model's random weights are made in FP8 directly)."""
    weight = layer.weight.data
    rows, cols = weight.shape
    step = max(RANDOM_CHUNK_ELEMENTS // max(cols, 1), 1)
    if layer.block_size is not None:
        step = max(step // layer.block_size[0], 1) * layer.block_size[0]
    for start in range(0, rows, step):
        chunk = torch.randn(min(step, rows - start), cols, generator=generator, device=weight.device) * std
        if layer.block_size is None:
            weight_q, scale = quantize_weight(chunk)
            layer.weight_scale.data[start:start + len(chunk)] = scale
        else:
            weight_q, scale = quantize_weight_blocks(chunk, layer.block_size)
            first = start // layer.block_size[0]
            layer.weight_scale.data[first:first + len(scale)] = scale
        weight[start:start + len(chunk)] = weight_q
