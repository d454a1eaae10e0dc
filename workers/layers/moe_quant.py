"""Quantized routed experts of a `FusedMoE` layer (workers/layers/moe.py): what it holds when built inside
`quantized_layers(config)`, and how each rank loads its slice of the checkpoint's per-expert tensors.
kernels/moe_quant.py computes with them (`quantized_experts` hands them over).

Integers (AWQ, GPTQ, compressed-tensors pack-quantized): every expert's projection is one int layer of
workers/layers/quantization_int.py, stacked (the K-first layouts of kernels/linear_int.py; compressed-tensors'
N-first tensors copied transposed, the same int32 words):

    w13_qweight  [E, H, 2 I_r / 8] (AWQ) or [E, H / p, 2 I_r]     w2_qweight  [E, I_r, H / 8] or [E, I_r / p, H]
    w13_qzeros   [E, G13, 2 I_r / p]                                w2_qzeros   [E, G2, H / p]
    w13_scales   [E, G13, 2 I_r]                                    w2_scales   [E, G2, H]
    w13_g_idx    [E, H]  (GPTQ, act-order)                          w2_g_idx    [E, I_r]

GGUF blocks (quantization="gguf": workers/weights.py `gguf_int_experts` rebuilds a layer's experts for its file's
types) arrive N-first as compressed-tensors' do, repacked along K by checkpoints/gguf_blocks.py, with `w13_mins` /
`w2_mins` [E, G, N] in place of qzeros where the type has minimums; gate/up and down may be of different types
(Q4_K_M files keep some down projections in Q6_K): each projection has its own packing and group size.

FP8 (quantization="fp8" online, per output row; or an FP8 checkpoint, per row / tensor / block):

    w13_weight   e4m3 [E, 2 I_r, H]     w13_weight_scale  [E, 2 I_r], or [E, 2 ceil(I_r / bn), ceil(H / bk)]
    w2_weight    e4m3 [E, H, I_r]       w2_weight_scale   [E, H],     or [E, ceil(H / bn), ceil(I_r / bk)]
    w13_input_scale, w2_input_scale     float32 [1] (static-activation checkpoints only): the largest of the
                                        experts' gate / up (down) input scales, rounded up to a power of two,
                                        as vLLM takes one static scale for all of a layer's experts (the kernel
                                        quantizes each GEMM's input once, for every expert)

Tensor parallelism, as the unquantized experts: rank r takes rows [r I_r, (r + 1) I_r) of each expert's gate and
up (its [gate ; up] w13: whole int32s of packed columns, whole FP8 scale blocks) and the same columns of its down
(w2's K: whole groups, unless act-order or one group keeps every group on every rank, as a row-parallel int layer
does; whole FP8 scale blocks). Online FP8 quantizes each rank's slice per row, so down's scales are its K shard's.
Under act-order an expert's gate and up must share one g_idx (they read one input); without it, a g_idx must be
k // group_size, and the kernel computes that instead of reading it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

from engine.quantization import QuantConfig
from kernels.fp8 import FP8_DTYPE, quantize_weight, quantize_weight_blocks
from kernels.linear_int import IntPacking, along_n
from kernels.moe_quant import Fp8Experts, IntExperts
from workers.layers.quantization import _blocks, static_input_scale
from workers.layers.quantization_int import (
    _divided,
    _mid_range_zeros,
    _random_scale,
    group_layout,
    group_rows,
    held_along_n,
    packing_of,
    scale_dtype_of,
)

_INT_TENSORS = ("qweight", "qzeros", "scales", "g_idx", "mins")


@dataclass(frozen=True)
class _Projection:
    """One stacked projection of this rank: [rows, cols] per expert (N_rank, K_rank); `full` (N, K) of a
    checkpoint tensor; `is_k_split`: down (its K split across ranks)."""

    name: str
    rows: int
    cols: int
    full: tuple[int, int]
    is_k_split: bool
    has_all_groups: bool = True
    num_groups: int = 1
    config: QuantConfig | None = None  # int experts: this projection's format
    packing: IntPacking | None = None
    is_n_major: bool = False  # the checkpoint's tensors are [N, ...] (compressed-tensors, GGUF)


def _projections(moe) -> list[_Projection]:
    ir, hidden, inter = moe.inter_per_rank, moe.hidden_size, moe.intermediate_size
    return [_Projection("w13", 2 * ir, hidden, (inter, hidden), False),
            _Projection("w2", hidden, ir, (hidden, inter), True)]


def _slices(moe, proj: str, shard_id) -> tuple[int, slice, slice, slice]:
    """(expert, checkpoint rows, this rank's rows, checkpoint columns) of one checkpoint tensor: w13's shard id is
    (expert, 0 gate / 1 up), w2's the expert."""
    r, ir = moe.tp_rank, moe.inter_per_rank
    if proj == "w13":
        expert, index = shard_id
        return expert, slice(r * ir, (r + 1) * ir), slice(index * ir, (index + 1) * ir), slice(None)
    return shard_id, slice(None), slice(None), slice(r * ir, (r + 1) * ir)


def _param(moe, shape, dtype, device, loader, proj: str) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    p.shard_ids = ([(e, j) for e in range(moe.num_experts) for j in (0, 1)] if proj == "w13"
                   else list(range(moe.num_experts)))
    return p


# ---- integers ------------------------------------------------------------------------------------------------------
def create_int_experts(moe, configs: dict[str, QuantConfig], device) -> None:
    """Gives `moe` the packed parameters of its experts (see the module docstring); `configs`: w13's and w2's
    format (one config for both but in a GGUF file)."""
    moe.projections = {}
    for proj in _projections(moe):
        config = configs[proj.name]
        packing = packing_of(config)
        p = packing.pack_factor
        if moe.inter_per_rank % p:
            raise ValueError(f"{config.method}: this rank's {moe.inter_per_rank} expert intermediate features do "
                             f"not fill whole int32s of {p} values (tensor_parallel_size {moe.tp_size})")
        has_all_groups, num_groups = group_layout(config, proj.cols, proj.full[1], proj.is_k_split, moe.tp_size,
                                                  "expert intermediate features", f"expert {proj.name}")
        if proj.rows % p or (packing.is_packed_along_k and proj.cols % p):
            raise ValueError(f"{config.method}: expert {proj.name} [{proj.rows}, {proj.cols}] is not whole int32s "
                             f"of {p} values (tensor_parallel_size {moe.tp_size})")
        proj = _Projection(proj.name, proj.rows, proj.cols, proj.full, proj.is_k_split, has_all_groups, num_groups,
                           config, packing, config.method in ("pack-quantized", "gguf"))
        moe.projections[proj.name] = proj
        _create_int_projection(moe, proj, device)
    moe.g_idx_loaded = set()


def _create_int_projection(moe, proj: _Projection, device) -> None:
    config, packing, E = proj.config, proj.packing, moe.num_experts
    p, rows, cols = packing.pack_factor, proj.rows, proj.cols
    qweight_shape = (E, cols // p, rows) if packing.is_packed_along_k else (E, cols, rows // p)
    scale_dtype = scale_dtype_of(config)
    shapes = {"qweight": (qweight_shape, torch.int32), "scales": ((E, proj.num_groups, rows), scale_dtype)}
    if config.has_mins:  # GGUF's w = q * scale + min: no zero points
        shapes["mins"] = ((E, proj.num_groups, rows), scale_dtype)
    else:
        shapes["qzeros"] = ((E, proj.num_groups, rows // p), torch.int32)
    if config.method == "gptq" or config.desc_act:
        shapes["g_idx"] = ((E, cols), torch.int32)
    first_k = moe.tp_rank * cols if proj.is_k_split and proj.has_all_groups else 0
    for name, (shape, dtype) in shapes.items():
        attr = f"{proj.name}_{name}"
        if name == "qzeros" and not config.has_zero_points:
            moe.register_buffer(attr, _mid_range_zeros(shape, packing, device))
            continue
        param = _param(moe, shape, dtype, device, functools.partial(_load_int, moe, proj, name), proj.name)
        param.random_init = functools.partial(_random_int, moe, proj, name, param, first_k)
        setattr(moe, attr, param)
    for name in ("g_idx", "mins", "qzeros"):
        if name not in shapes:
            setattr(moe, f"{proj.name}_{name}", None)


@torch.no_grad()
def finish_int_experts(moe) -> None:
    """Once the experts have loaded: each projection a dense layer of its format would hold along N
    (`held_along_n`: GPTQ's and compressed-tensors' 4 bits without act-order; act-order experts are not sorted, as
    each expert's order differs and the fused kernel reads x's rows unpermuted) repacked so, expert by expert
    (`kernels.linear_int.along_n`: the same weights exactly), for the same decode kernel's reasons."""
    for name, proj in list(moe.projections.items()):
        if not held_along_n(proj.config, proj.packing, proj.config.desc_act):
            continue
        qweight, qzeros = getattr(moe, f"{name}_qweight"), getattr(moe, f"{name}_qzeros")
        words = torch.empty(moe.num_experts, proj.cols, proj.rows // 8, dtype=torch.int32, device=qweight.device)
        zeros = torch.empty_like(qzeros)
        for e in range(moe.num_experts):
            words[e], zeros[e], packing = along_n(qweight.data[e], qzeros.data[e], proj.packing)
        setattr(moe, f"{name}_qweight", nn.Parameter(words, requires_grad=False))
        setattr(moe, f"{name}_qzeros", nn.Parameter(zeros, requires_grad=False) if isinstance(qzeros, nn.Parameter)
                else zeros)
        moe.projections[name] = dataclasses.replace(proj, packing=packing)


def _load_int(moe, proj: _Projection, name: str, param: nn.Parameter, loaded, shard_id) -> None:
    expert, n_src, n_dst, k_src = _slices(moe, proj.name, shard_id)
    if name == "g_idx":
        _load_g_idx(moe, proj, param, loaded[k_src], expert)
        return
    packing, p = proj.packing, proj.packing.pack_factor
    if name == "qweight":
        _check_full_shape(proj, loaded)
        k_rows = _divided(k_src, p, "input features") if packing.is_packed_along_k else k_src
        n_div = 1 if packing.is_packed_along_k else p
    else:  # qzeros, scales, mins: a row per group (w2's k_src: this rank's, whole groups: checked at creation)
        k_rows = slice(None) if proj.has_all_groups else group_rows(k_src, proj.config.group_size, moe.tp_size)
        n_div = p if name == "qzeros" else 1
    n_src, n_dst = _divided(n_src, n_div, "output features"), _divided(n_dst, n_div, "output features")
    part = loaded[n_src, k_rows].t() if proj.is_n_major else loaded[k_rows, n_src]
    dst = param.data[expert][:, n_dst]
    if name not in ("scales", "mins") and part.dtype != torch.int32:
        raise ValueError(f"a {proj.config.method} checkpoint's expert {name} must be int32, got {part.dtype}")
    assert tuple(dst.shape) == tuple(part.shape), (f"expert {proj.name} {name}: shape mismatch: parameter "
                                                   f"{tuple(dst.shape)}, loaded {tuple(part.shape)}")
    dst.copy_(part)


def _check_full_shape(proj: _Projection, loaded) -> None:
    """An expert's packed weight must be the model's [N, K] (a rank reads only its slice: a wrong width would
    load silently otherwise)."""
    (n, k), p = proj.full, proj.packing.pack_factor
    if proj.is_n_major:
        expected = (n, k // p)
    else:
        expected = (k // p, n) if proj.packing.is_packed_along_k else (k, n // p)
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    if shape != expected:
        raise ValueError(f"an expert's {proj.name} packed weight is {shape}; the config's [{n}, {k}] packs to "
                         f"{expected}")


def _load_g_idx(moe, proj: _Projection, param: nn.Parameter, part, expert: int) -> None:
    part = (part if isinstance(part, torch.Tensor) else part[:]).to(torch.int32)
    config = proj.config
    g = config.group_size
    first = 0 if proj.has_all_groups else moe.tp_rank * proj.cols
    part = part - first // g if g is not None else part
    if part.numel() and (int(part.min()) < 0 or int(part.max()) >= proj.num_groups):
        raise ValueError(f"an expert's g_idx names groups outside this rank's {proj.num_groups}")
    if not config.desc_act:  # in order: the kernel computes k // group_size instead of reading it
        k = torch.arange(first, first + part.numel(), dtype=torch.int32)
        if not torch.equal(part, k // g - first // g if g is not None else torch.zeros_like(k)):
            raise ValueError("an expert's g_idx is out of order: act-order needs desc_act true in "
                             "quantization_config")
    dst = param.data[expert]
    if (proj.name, expert) in moe.g_idx_loaded and not torch.equal(dst, part.to(dst.device)):
        raise ValueError(f"expert {expert}'s gate and up projections have different g_idx: they must share the "
                         "input's act-order")
    dst.copy_(part)
    moe.g_idx_loaded.add((proj.name, expert))


@torch.no_grad()
def _random_int(moe, proj: _Projection, name: str, param: nn.Parameter, first_k: int, std: float,
                generator: torch.Generator) -> None:
    """load_format="random": as workers/layers/quantization_int.py draws an int layer's, for every expert."""
    bits, g = proj.packing.bits, proj.config.group_size
    if name == "qweight":
        param.copy_(torch.randint(-2**31, 2**31 - 1, param.shape, generator=generator, device=param.device,
                                  dtype=torch.int32))
    elif name == "qzeros":
        param.copy_(_mid_range_zeros(param.shape, proj.packing, param.device))
    elif name == "scales":
        param.fill_(_random_scale(std, bits))
    elif name == "mins":  # centred as a zero point of 2^(bits - 1) would centre them
        param.fill_(-(1 << (bits - 1)) * _random_scale(std, bits))
    else:
        k = torch.arange(first_k, first_k + param.shape[1], dtype=torch.int32, device=param.device)
        param.copy_((k // g if g is not None else torch.zeros_like(k)).expand_as(param))


# ---- FP8 -----------------------------------------------------------------------------------------------------------
def create_fp8_experts(moe, config: QuantConfig, device) -> None:
    """Gives `moe` FP8 experts (see the module docstring); online (a float checkpoint) they are quantized per row
    as they load."""
    moe.block_size = config.block_size if config.weight == "block" else None
    moe.projections = {proj.name: proj for proj in _projections(moe)}
    for proj in moe.projections.values():
        if moe.block_size is not None:
            _check_whole_blocks(moe, proj)
        weight = _param(moe, (moe.num_experts, proj.rows, proj.cols), FP8_DTYPE, device,
                        functools.partial(_load_fp8_weight, moe, proj), proj.name)
        weight.random_init = functools.partial(_random_fp8, moe, proj)
        setattr(moe, f"{proj.name}_weight", weight)
        shape = _fp8_scale_shape(moe, proj)
        if config.is_checkpoint_fp8:
            scale = _param(moe, shape, torch.float32, device, functools.partial(_load_fp8_scale, moe, proj),
                           proj.name)
            scale.random_init = lambda std, generator: None  # set with the weight
            setattr(moe, f"{proj.name}_weight_scale", scale)
        else:
            moe.register_buffer(f"{proj.name}_weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        input_scale = None
        if config.activation == "static":  # every expert's gate / up (down) scale into one
            input_scale = static_input_scale(device)
            input_scale.shard_ids = weight.shard_ids
        setattr(moe, f"{proj.name}_input_scale", input_scale)


def _fp8_scale_shape(moe, proj: _Projection) -> tuple[int, ...]:
    if moe.block_size is None:
        return moe.num_experts, proj.rows
    bn, bk = moe.block_size
    parts = 2 if proj.name == "w13" else 1
    return moe.num_experts, parts * -(-(proj.rows // parts) // bn), -(-proj.cols // bk)


def _check_whole_blocks(moe, proj: _Projection) -> None:
    bn, bk = moe.block_size
    block, what = (bn, "rows") if proj.name == "w13" else (bk, "columns")
    if moe.tp_size > 1 and moe.inter_per_rank % block:
        raise ValueError(f"tensor_parallel_size {moe.tp_size}: this rank's {moe.inter_per_rank} expert "
                         f"intermediate {what} of {proj.name} are not whole scale blocks of weight_block_size "
                         f"{list(moe.block_size)}; use a tensor_parallel_size whose shards cover whole blocks")


def _load_fp8_weight(moe, proj: _Projection, param: nn.Parameter, loaded, shard_id) -> None:
    expert, n_src, n_dst, k_src = _slices(moe, proj.name, shard_id)
    part = loaded[n_src, k_src]
    dst = param.data[expert][n_dst]
    if moe.quant_config.is_checkpoint_fp8:
        if part.dtype != FP8_DTYPE:
            raise ValueError(f"an FP8 checkpoint's expert weight must be float8_e4m3fn, got {part.dtype}")
    else:  # online: this rank's rows of its slice, a scale each
        part, scale = quantize_weight(part.to(dst.device))
        getattr(moe, f"{proj.name}_weight_scale").data[expert][n_dst] = scale
    assert tuple(dst.shape) == tuple(part.shape), (f"expert {proj.name}: shape mismatch: parameter "
                                                   f"{tuple(dst.shape)}, loaded {tuple(part.shape)}")
    dst.copy_(part)


def _load_fp8_scale(moe, proj: _Projection, param: nn.Parameter, loaded, shard_id) -> None:
    expert, n_src, n_dst, k_src = _slices(moe, proj.name, shard_id)
    dst = param.data[expert]
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    if moe.block_size is None:
        # a scale per tensor (expanded to its rows), or per row ([N, 1] or [N])
        part = loaded[...].float().reshape(()) if all(d == 1 for d in shape) else loaded[n_src].float().reshape(-1)
        dst[n_dst] = part
        return
    bn, bk = moe.block_size
    part = loaded[_blocks(n_src, bn, "rows"), _blocks(k_src, bk, "columns")].float()
    if proj.name == "w13":  # gate's blocks, then up's
        nb = dst.shape[0] // 2
        dst = dst[n_dst.start // moe.inter_per_rank * nb:][:nb]
    assert tuple(dst.shape) == tuple(part.shape), (f"expert {proj.name} block scales: parameter "
                                                   f"{tuple(dst.shape)}, loaded {tuple(part.shape)}")
    dst.copy_(part)


@torch.no_grad()
def _random_fp8(moe, proj: _Projection, std: float, generator: torch.Generator) -> None:
    """N(0, std) weights drawn per expert (and per gate / up part) on the device and quantized there."""
    weight, scale = getattr(moe, f"{proj.name}_weight").data, getattr(moe, f"{proj.name}_weight_scale").data
    parts = 2 if proj.name == "w13" else 1
    rows = proj.rows // parts
    for expert in range(moe.num_experts):
        for i in range(parts):
            w = torch.randn(rows, proj.cols, generator=generator, device=weight.device) * std
            if moe.block_size is None:
                q, s = quantize_weight(w)
                scale[expert, i * rows:(i + 1) * rows] = s
            else:
                q, s = quantize_weight_blocks(w, moe.block_size)
                scale[expert, i * len(s):(i + 1) * len(s)] = s
            weight[expert, i * rows:(i + 1) * rows] = q


# ---- handing them to the kernel ------------------------------------------------------------------------------------
def quantized_experts(moe) -> tuple[IntExperts | Fp8Experts, IntExperts | Fp8Experts]:
    """(w13, w2) of a FusedMoE with quantized experts, as kernels/moe_quant.py takes them."""
    if moe.quant_config.is_packed_int:
        return tuple(IntExperts(getattr(moe, f"{p.name}_qweight"), getattr(moe, f"{p.name}_qzeros"),
                                getattr(moe, f"{p.name}_scales"),
                                getattr(moe, f"{p.name}_g_idx") if p.config.desc_act else None, p.config.group_size,
                                p.packing, getattr(moe, f"{p.name}_mins"))
                     for p in (moe.projections["w13"], moe.projections["w2"]))  # type: ignore[return-value]
    return (Fp8Experts(moe.w13_weight, moe.w13_weight_scale, moe.block_size, parts=2,
                       input_scale=moe.w13_input_scale),
            Fp8Experts(moe.w2_weight, moe.w2_weight_scale, moe.block_size, input_scale=moe.w2_input_scale))
