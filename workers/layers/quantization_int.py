"""Weight-only integer linear layers (AWQ, GPTQ, compressed-tensors pack-quantized, GGUF blocks): what such a
tensor-parallel layer holds and how its shards load.

Built inside `quantized_layers(config)` with an int QuantConfig, every ColumnParallel / MergedColumn / QKV
/ RowParallel linear holds this rank's slice of the checkpoint's tensors, as stored (kernels/linear_int.py has
the layouts), under AWQ's and GPTQ's names:

    qweight  int32  AWQ [K_rank, N_rank / 8]     GPTQ [K_rank / p, N_rank]      (p = 32 / bits)
    qzeros   int32  [G_rank, N_rank / p]         (a buffer of 2^(bits - 1) when the checkpoint stores none)
    scales   fp16   [G_rank, N_rank]             (float32 where fp16 would round them: QuantConfig.scale_dtype)
    g_idx    int32  [K_rank] (GPTQ, act-order compressed-tensors): each input feature's group among G_rank

compressed-tensors stores the transposes, N first (weight_packed [N, K / p], weight_scale [N, G],
weight_zero_point [N / p, G], packed along N): the same int32 words, so a rank indexes its [N, K] slice of them
and copies it transposed (`is_n_major`); workers/weights.py renames the tensors to the names above. GGUF blocks
(quantization="gguf") arrive in that N-first layout too, repacked by checkpoints/gguf_blocks.py, with no zero
points (a mid-range buffer) or with `mins` [G_rank, N_rank] in place of qzeros (w = q * scale + min), groups of
32 or 16 (checkpoints/gguf_types.py).

Once loaded, a 4-bit layer packed along K with zero points (GPTQ, compressed-tensors int4, GGUF's Q4_0) is repacked
along N in AWQ's order, an act-order one first sorted by group, the same weights exactly (`finish_int_weights`);
`layer.packing` says which layout a layer holds.

A column-parallel layer takes its N slice (whole int32s of AWQ's packed columns: N_rank a multiple of 8), fused
q/k/v and gate/up each part into its rows, as the unquantized loaders do. A row-parallel layer takes its K slice
and the groups of it, which must start and end on group boundaries (else a ValueError naming
tensor_parallel_size and group_size); with GPTQ's act-order (g_idx in any order) or one group over all of K, a
rank's inputs may belong to any group, so it keeps every group's scales and zeros (they are small) and its slice
of g_idx.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.quantization import QuantConfig
from kernels.linear_int import AWQ_GEMM, IntPacking, along_n, gptq_v1, group_index, offset_binary, sorted_by_group
from kernels.linear_int import linear_int as linear_int_kernel


def packing_of(config: QuantConfig) -> IntPacking:
    if config.method == "awq":
        return AWQ_GEMM
    if config.method == "gptq" and config.checkpoint_format != "gptq_v2":
        return gptq_v1(config.bits)
    return offset_binary(config.bits)  # GPTQ v2: v1's layout, zero points as they are


def scale_dtype_of(config: QuantConfig) -> torch.dtype:
    """The dtype a layer (or an expert projection) keeps its scales and mins in."""
    return {"float16": torch.float16, "float32": torch.float32}[config.scale_dtype]


def group_layout(config: QuantConfig, cols: int, k_total: int, is_k_split: bool, tp_size: int,
                 features: str = "input features", name: str = "") -> tuple[bool, int]:
    """(has_all_groups, num_groups) of a layer whose rank holds `cols` of its `k_total` input features. Every group
    stays on every rank with one group, act-order, or K not split; else a rank's K slice must be whole groups (a
    ValueError naming tensor_parallel_size and group_size). `features` and `name` word the errors."""
    g = config.group_size
    has_all_groups = g is None or config.desc_act or not is_k_split
    if g is not None and k_total % g:
        raise ValueError(f"{name + ': ' if name else ''}in_features {k_total} is not a multiple of group_size {g}")
    if not has_all_groups and cols % g:
        raise ValueError(f"tensor_parallel_size {tp_size}: this rank's {cols} {features} are not whole groups of "
                         f"group_size {g}; use a tensor_parallel_size that splits them on group boundaries")
    return has_all_groups, (1 if g is None else k_total // g) if has_all_groups else cols // g


def group_rows(k: slice, group_size: int, tp_size: int) -> slice:
    """The rows of scales / zeros / mins (a row a group) that input features `k` span: whole groups."""
    if k.start % group_size or k.stop % group_size:
        raise ValueError(f"tensor_parallel_size {tp_size}: this rank's input features [{k.start}, {k.stop}) "
                         f"split a group of group_size {group_size}")
    return slice(k.start // group_size, k.stop // group_size)


def _mid_range_zeros(shape, packing: IntPacking, device) -> torch.Tensor:
    """Packed zero points of 2^(bits - 1) (as stored, less the packing's zero_offset) in every field."""
    stored = (1 << (packing.bits - 1)) - packing.zero_offset
    word = sum(stored << (packing.bits * i) for i in range(packing.pack_factor))
    return torch.full(shape, word - (1 << 32) if word >= 1 << 31 else word, dtype=torch.int32, device=device)


def _param(shape, dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


def create_int_weights(layer: nn.Module, rows: int, cols: int, device, config: QuantConfig,
                       is_k_split: bool) -> None:
    """Gives `layer` (which has `shard(shard_id) -> Shard` and `tp_size`) the packed parameters for its
    [rows = N_rank, cols = K_rank] weight; `is_k_split`: a row-parallel layer (K split across ranks)."""
    packing = packing_of(config)
    p, g = packing.pack_factor, config.group_size
    layer.quant_config, layer.packing, layer.group_size = config, packing, g
    layer.is_n_major = config.method in ("pack-quantized", "gguf")  # the checkpoint's tensors are [N, ...]
    k_total = cols * layer.tp_size if is_k_split else cols
    layer.has_all_groups, num_groups = group_layout(config, cols, k_total, is_k_split, layer.tp_size)
    packed_sizes = {"output features": rows, **({"input features": cols} if packing.is_packed_along_k else {})}
    for what, size in packed_sizes.items():  # qzeros always pack N; GPTQ's qweight packs K
        if size % p:
            raise ValueError(f"{config.method}: this rank's {size} {what} do not fill whole int32s of {p} values "
                             f"(tensor_parallel_size {layer.tp_size})")
    qweight_shape = (cols // p, rows) if packing.is_packed_along_k else (cols, rows // p)
    loader = _loader(layer)
    layer.qweight = _param(qweight_shape, torch.int32, device, loader)
    layer.mins = None
    scale_dtype = scale_dtype_of(config)
    if config.has_mins:  # GGUF Q4_1 / Q5_1 / Q4_K / Q5_K: w = q * scale + min
        layer.qzeros = None
        layer.mins = _param((num_groups, rows), scale_dtype, device, loader)
    elif config.has_zero_points:
        layer.qzeros = _param((num_groups, rows // p), torch.int32, device, loader)
    else:
        layer.register_buffer("qzeros", _mid_range_zeros((num_groups, rows // p), packing, device))
    layer.scales = _param((num_groups, rows), scale_dtype, device, loader)
    has_g_idx = config.method == "gptq" or config.desc_act
    layer.g_idx = _param((cols,), torch.int32, device, loader) if has_g_idx else None
    layer.weight = None  # no float weight anywhere
    # x's columns in the order of W's input features once sorted (act-order: finish_int_weights); a buffer, so it
    # moves with the layer
    layer.register_buffer("input_perm", None, persistent=False)
    layer.block_size = layer.input_scale = None
    first_k = layer.tp_rank * cols if is_k_split and layer.has_all_groups else 0
    for param in (layer.qweight, layer.qzeros, layer.scales, layer.g_idx, layer.mins):
        if param is not None:
            param.random_init = functools.partial(_random_init, layer, param, first_k)


@torch.no_grad()
def _random_init(layer, param: nn.Parameter, first_k: int, std: float, generator: torch.Generator) -> None:
    """Random weights drawn in the packed format directly (load_format="random"): uniform integers around a zero
    point in the middle of their range, scales that give them standard deviation `std`, g_idx in order."""
    bits, packing = layer.quant_config.bits, layer.packing
    if param is layer.qweight:
        param.copy_(torch.randint(-2**31, 2**31 - 1, param.shape, generator=generator, device=param.device,
                                  dtype=torch.int32))
    elif param is layer.qzeros:
        param.copy_(_mid_range_zeros(param.shape, packing, param.device))
    elif param is layer.scales:
        param.fill_(_random_scale(std, bits))
    elif param is layer.mins:  # centred as a zero point of 2^(bits - 1) would centre them
        param.fill_(-(1 << (bits - 1)) * _random_scale(std, bits))
    else:
        k = torch.arange(first_k, first_k + param.shape[0], dtype=torch.int32, device=param.device)
        param.copy_(k // layer.group_size if layer.group_size is not None else torch.zeros_like(k))


def _random_scale(std: float, bits: int) -> float:
    return std / (((1 << bits) ** 2 - 1) / 12) ** 0.5  # a uniform integer's standard deviation


def held_along_n(config: QuantConfig, packing: IntPacking, act_order: bool) -> bool:
    """Whether a layer (or an expert projection) of this format packed so is repacked along N once loaded (see
    `finish_int_weights`): 4 bits along K with zero points (GGUF's minimums stream along K), no act-order
    (`act_order`: a g_idx still in use)."""
    return packing.bits == 4 and packing.is_packed_along_k and not act_order and not config.has_mins


def finish_int_weights(layer: nn.Module) -> None:
    """Once the weights have loaded (workers/weights.py), two exact rewrites of what the layer holds:

    - act-order (GPTQ's desc_act, compressed-tensors' actorder "group"): the input features sorted by group
      (`kernels.linear_int.sorted_by_group`), so the layer reads a K tile's zeros and scales as one row and x's
      columns are permuted once a call (`layer.input_perm`, in `linear.matmul`) instead of W's every call: the
      kernels that take no g_idx (the streaming one) take it. Not where a rank holds part of some groups (a
      row-parallel layer at tp > 1, whose K slice is any features) or one group spans K.
    - 4 bits packed along K without act-order, with zero points (GPTQ, compressed-tensors int4, GGUF's Q4_0):
      repacked along N in AWQ's order (`kernels.linear_int.along_n`), the layout whose decode kernel reads x's tile
      whole. Packed along K, each field's dot in kernels/int_decode.py takes x's columns 8r + j, which the sm_90
      SASS gathers with 2-byte loads staged through shared memory, 16-20 barriers a K tile where AWQ's layout has 2
      (GPTQ's groups of 32 streamed at 0.25-0.33 TB/s on an H100, AWQ's 128 at 1.0-2.0). GGUF's types with
      minimums (streamed along K at 0.8-1.3 TB/s there), 8-bit layers and a layer whose output features (a fused
      part's) are not whole int32s of 8 keep their layout."""
    config = layer.quant_config
    if config.desc_act and layer.g_idx is not None and layer.group_size is not None:
        ordered = sorted_by_group(layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.g_idx.data,
                                  layer.group_size, layer.packing)
        if ordered is not None:
            perm, qweight, qzeros, scales = ordered
            in_order = torch.equal(perm, torch.arange(perm.numel(), device=perm.device))
            layer.input_perm = None if in_order else perm  # (a g_idx already in order: no gather)
            layer.qweight, layer.scales = _frozen(qweight), _frozen(scales)
            _set_zeros(layer, qzeros)
            layer.g_idx = None
    parts = getattr(layer, "sizes_per_rank", None) or [layer.qweight.shape[1]]
    act_order = config.desc_act and layer.g_idx is not None
    if not held_along_n(config, layer.packing, act_order) or any(n % 8 for n in parts):
        return
    qweight, qzeros, layer.packing = along_n(layer.qweight.data, layer.qzeros.data, layer.packing)
    layer.qweight = _frozen(qweight)
    _set_zeros(layer, qzeros)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _set_zeros(layer: nn.Module, qzeros: torch.Tensor) -> None:
    """qzeros replaced: a parameter, or the mid-range buffer of a checkpoint without zero points."""
    layer.qzeros = _frozen(qzeros) if isinstance(layer.qzeros, nn.Parameter) else qzeros


def linear_int(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> torch.Tensor:
    """The layer's x [T, K_rank] @ W.T (+ bias) -> [T, N_rank] (gated: [T, N_rank / 2]). Without act-order a GPTQ
    g_idx is k // group_size (checked at load): the kernels then read a group's zeros and scales once a tile
    instead of gathering them per element."""
    g_idx = layer.g_idx if layer.quant_config.desc_act else None
    return linear_int_kernel(x, layer.qweight, layer.qzeros, layer.scales, g_idx, layer.group_size, layer.packing,
                             bias, gated, layer.mins)


def _loader(layer):
    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        name = next(n for n in ("qweight", "qzeros", "scales", "g_idx", "mins") if getattr(layer, n) is param)
        _load(layer, name, param, loaded, shard_id)
    return load


def _load(layer, name: str, param: nn.Parameter, loaded, shard_id) -> None:
    shard, packing = layer.shard(shard_id), layer.packing
    p = packing.pack_factor
    k_src = shard.src_cols if shard.src_cols is not None else slice(None)  # K slice (row-parallel) or all
    if name == "g_idx":
        _load_g_idx(layer, param, loaded[k_src], shard_id)
        return
    if name == "qweight":
        k_rows = _divided(k_src, p, "input features") if packing.is_packed_along_k else k_src
        n_div = 1 if packing.is_packed_along_k else p
    else:  # qzeros, scales, mins: a row per group
        k_rows = slice(None) if layer.has_all_groups else group_rows(k_src, layer.group_size, layer.tp_size)
        n_div = p if name == "qzeros" else 1
    n_src, n_dst = _divided(shard.src_rows, n_div, "output features"), _divided(shard.dst, n_div, "output features")
    part = loaded[n_src, k_rows].t() if layer.is_n_major else loaded[k_rows, n_src]
    dst = param.data[:, n_dst]
    assert tuple(dst.shape) == tuple(part.shape), (f"{name}: shape mismatch: parameter {tuple(dst.shape)}, "
                                                   f"loaded {tuple(part.shape)}")
    if name not in ("scales", "mins") and part.dtype != torch.int32:
        raise ValueError(f"an {layer.quant_config.method} checkpoint's {name} must be int32, got {part.dtype}")
    dst.copy_(part)


def _load_g_idx(layer, param: nn.Parameter, part: torch.Tensor, shard_id) -> None:
    part = part.to(torch.int32)
    if not layer.has_all_groups:  # this rank's groups only: number them from its first
        part = part - layer.shard(shard_id).src_cols.start // layer.group_size
    if part.numel() and (int(part.min()) < 0 or int(part.max()) >= layer.scales.shape[0]):
        raise ValueError(f"g_idx names groups outside this rank's {layer.scales.shape[0]} (a g_idx out of "
                         "order needs desc_act true in quantization_config)")
    in_order = group_index(part.shape[0], layer.group_size, part.device)
    if not layer.quant_config.desc_act and not torch.equal(part, in_order):
        raise ValueError("quantization_config: desc_act false, but g_idx is not input feature // group_size (a g_idx "
                         "out of order needs desc_act true)")
    loaded_parts = getattr(layer, "g_idx_loaded", set())
    if loaded_parts and not torch.equal(param.data, part.to(param.device)):
        raise ValueError(f"the fused parts of a layer have different g_idx ({sorted(loaded_parts, key=str)} and "
                         f"{shard_id!r}): q/k/v and gate/up must share the input's act-order")
    param.data.copy_(part)
    layer.g_idx_loaded = loaded_parts | {shard_id}


def _divided(s: slice, d: int, what: str) -> slice:
    """A slice of values as a slice of the int32s packing `d` of them."""
    if s.start is None and s.stop is None:
        return s
    if s.start % d or s.stop % d:
        raise ValueError(f"this rank's {what} [{s.start}, {s.stop}) are not whole int32s of {d} packed values; "
                         "use another tensor_parallel_size")
    return slice(s.start // d, s.stop // d)
