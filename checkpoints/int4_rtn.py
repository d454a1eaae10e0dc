"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints written from a float one, quantized round-to-nearest
per group and packed as the producing tools pack them (AutoAWQ, AutoGPTQ and llm-compressor are not installed
here); and the oracle: the same model with the dequantized weights, written as a float32 checkpoint. The tests
write their int checkpoints with it, and `pagoda bench quality --quantization awq|gptq` its int4 SmolLM2.

The packing, restated from the tools (not from Pagoda's unpacking, which the tests check against it):
- AutoAWQ, version "gemm" (awq/modules/linear/gemm.py, awq/utils/packing_utils.py): the integers as [K, N];
  qweight int32 [K, N / 8], the int32 of columns 8c..8c+7 holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] in its
  nibble i (bits 4i..4i+3); qzeros int32 [K / g, N / 8] packed the same way; scales fp16 [K / g, N];
  w = (q - zero) * scale.
- AutoGPTQ / GPTQModel, the v1 format (qlinear_cuda_old.py's pack): qweight int32 [K / p, N] (p = 32 / bits),
  row r holding input features p r + j in field j (bits j up); qzeros int32 [K / g, N / p], the zero points
  minus one packed along N in the same sequential order; scales fp16 [K / g, N]; g_idx int32 [K]. The weight
  columns stay in the model's order under act-order: g_idx says each input feature's group. GPTQModel's
  `checkpoint_format: "gptq_v2"` stores the zero points as they are (its v1 -> v2 conversion adds 1 to every
  field), so a zero of 0 is stored too; both tools also write quantize_config.json beside config.json.
- compressed-tensors, format "pack-quantized" (llm-compressor's W4A16 / W8A16; compressed_tensors'
  PackedQuantizationCompressor and pack_to_int32): the signed integers q - 2^(bits-1) as [N, K], stored plus
  2^(bits-1) (unsigned) and packed along K in order: weight_packed int32 [N, K / p], input feature p c + j in field
  j; weight_scale [N, G] in the model's dtype (bf16 here); weight_zero_point (asymmetric only) int32 [N / p, G],
  the signed zero points stored the same way, packed along N; weight_g_idx int32 [K] (actorder "group");
  weight_shape int64 [2] = [N, K]. Symmetric: no zero points, w = q_signed * scale.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# Phi-3's checkpoints fuse q/k/v and gate/up: the tools quantize and pack each fused tensor as one linear; Mixtral's
# experts are w1 (gate) / w3 (up) / w2 (down); routers ("gate") and shared_expert_gate stay float
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
           "w1", "w2", "w3", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # the last: DeepSeek-V2's MLA
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i holds column AWQ_PACK_ORDER[i]


@dataclass(frozen=True)
class Int4Format:
    """What to write: method "awq" / "gptq" / "pack-quantized", bits, group_size (-1: one group; pack-quantized:
    strategy "channel"), sym (GPTQ, pack-quantized; AWQ is always asymmetric), desc_act (act-order, a shuffled
    g_idx: GPTQ's desc_act, compressed-tensors' actorder "group")."""

    method: str
    group_size: int = 32
    bits: int = 4
    sym: bool = False
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ's: "gptq" (v1) or "gptq_v2"

    @property
    def name(self) -> str:
        sym = ("-sym" if self.sym else "-asym") if self.method != "awq" else ""
        method = "ct" if self.method == "pack-quantized" else self.method
        v2 = "-v2" if self.is_gptq_v2 else ""
        return f"{method}{self.bits}-g{self.group_size}{sym}{'-act' if self.desc_act else ''}{v2}"

    @property
    def is_gptq_v2(self) -> bool:
        return self.method == "gptq" and self.checkpoint_format == "gptq_v2"

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.method == "pack-quantized" else torch.float16

    def quantization_config(self) -> dict:
        if self.method == "pack-quantized":  # as llm-compressor writes it (QuantizationConfig.to_dict, trimmed)
            channel = self.group_size == -1
            weights = {"num_bits": self.bits, "type": "int", "symmetric": self.sym, "dynamic": False,
                       "strategy": "channel" if channel else "group", "group_size": None if channel else
                       self.group_size, "actorder": "group" if self.desc_act else None, "observer": "minmax",
                       "observer_kwargs": {}, "block_structure": None}
            return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "quantization_status": "compressed", "global_compression_ratio": None,
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                  "input_activations": None, "output_activations": None,
                                                  "format": "pack-quantized"}},
                    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "version": "0.10.2"}
        if self.method == "awq":  # as AutoAWQ writes it (transformers' AwqConfig.to_dict, trimmed)
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        if self.is_gptq_v2:  # as GPTQModel writes it (QuantizeConfig.to_dict, trimmed)
            return {"bits": self.bits, "dynamic": None, "group_size": self.group_size, "desc_act": self.desc_act,
                    "sym": self.sym, "lm_head": False, "quant_method": "gptq", "checkpoint_format": "gptq_v2",
                    "pack_dtype": "int32", "meta": {"quantizer": ["gptqmodel:2.2.0"], "damp_percent": 0.05,
                                                    "true_sequential": True, "static_groups": False}}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
                "checkpoint_format": "gptq", "model_name_or_path": None, "model_file_base_name": None}


@dataclass
class Quantized:
    """One linear layer's round-to-nearest quantization: q int [K, N], zeros int [G, N], scales fp16 [G, N],
    g_idx int [K]."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """w [N, K] float32."""
        g = self.g_idx.long()
        return ((self.q - self.zeros[g]).float() * self.scales[g].float()).t().contiguous()


def quantize(w: torch.Tensor, fmt: Int4Format, order: torch.Tensor | None = None) -> Quantized:
    """w [N, K] -> integers per group of input features; under act-order the groups are those of `order`, a
    permutation of K (GPTQ's order by the Hessian's diagonal: the same for layers that read the same input)."""
    n, k = w.shape
    g = k if fmt.group_size == -1 else fmt.group_size
    maxq = (1 << fmt.bits) - 1
    order = order if fmt.desc_act and order is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    groups = w.float().t()[order].reshape(k // g, g, n)  # [G, g, N]: each group's inputs, in act-order
    lo, hi = groups.amin(dim=1).clamp(max=0), groups.amax(dim=1).clamp(min=0)
    if fmt.sym:  # GPTQ's symmetric grid: zero in the middle
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scales = ((hi - lo) / maxq).clamp(min=1e-6).to(fmt.scale_dtype)
    if fmt.sym:
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.int32)
    else:  # GPTQ v1 cannot store a zero of 0 (it keeps zero - 1): 1..maxq; AWQ the same range, harmlessly; v2 0..
        zeros = torch.round(-lo / scales.float()).clamp(0 if fmt.is_gptq_v2 else 1, maxq).to(torch.int32)
    wk = w.float().t()  # [K, N]
    gk = g_idx.long()
    q = torch.round(wk / scales[gk].float() + zeros[gk]).clamp(0, maxq).to(torch.int32)
    return Quantized(q, zeros, scales, g_idx)


def _packed(values: np.ndarray, axis: int, bits: int, order) -> torch.Tensor:
    """uint32 packing of `values` (unsigned, < 2^bits) along `axis`: int32 i holds value order[f] of its run in
    field f; returned as the int32 the tools save. A length that is not a multiple of the 32 / bits values an
    int32 holds is padded with zeros (compressed-tensors' pack_to_int32: ceil(len * bits / 32) int32s)."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    p = 32 // bits
    if v.shape[0] % p:
        v = np.concatenate([v, np.zeros((p - v.shape[0] % p,) + v.shape[1:], dtype=np.uint32)])
    out = np.zeros((v.shape[0] // p,) + v.shape[1:], dtype=np.uint32)
    for field, j in enumerate(order):
        out |= v[j::p] << np.uint32(bits * field)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(out, 0, axis)).view(np.int32))


def pack_awq(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": _packed(qz.q.numpy(), 1, 4, AWQ_PACK_ORDER),
            "qzeros": _packed(qz.zeros.numpy(), 1, 4, AWQ_PACK_ORDER), "scales": qz.scales}


def pack_gptq(qz: Quantized, bits: int, v2: bool = False) -> dict[str, torch.Tensor]:
    seq = range(32 // bits)
    stored = (qz.zeros - (0 if v2 else 1)).numpy().astype(np.int64) & ((1 << bits) - 1)  # v1: zero - 1
    return {"qweight": _packed(qz.q.numpy(), 0, bits, seq), "qzeros": _packed(stored, 1, bits, seq),
            "scales": qz.scales, "g_idx": qz.g_idx}


def pack_compressed_tensors(qz: Quantized, bits: int, sym: bool, has_g_idx: bool) -> dict[str, torch.Tensor]:
    """The unsigned integers of `quantize` are compressed-tensors' signed ones plus 2^(bits-1): what
    pack_to_int32 stores."""
    seq = range(32 // bits)
    k, n = qz.q.shape
    parts = {"weight_packed": _packed(qz.q.t().numpy(), 1, bits, seq), "weight_scale": qz.scales.t().contiguous(),
             "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        parts["weight_zero_point"] = _packed(qz.zeros.t().numpy(), 0, bits, seq)
    if has_g_idx:
        parts["weight_g_idx"] = qz.g_idx
    return parts


def pack(qz: Quantized, fmt: Int4Format) -> dict[str, torch.Tensor]:
    if fmt.method == "awq":
        return pack_awq(qz)
    if fmt.method == "gptq":
        return pack_gptq(qz, fmt.bits, fmt.is_gptq_v2)
    return pack_compressed_tensors(qz, fmt.bits, fmt.sym, fmt.desc_act)


def linear_in_features(tensors: dict[str, torch.Tensor], float_modules: tuple[str, ...] = ()) -> dict[str, int]:
    """module -> input features, for each linear module `write_int4_checkpoint` quantizes."""
    return {name.rpartition(".")[0]: t.shape[1] for name, t in tensors.items()
            if name.endswith(".weight") and t.dim() == 2 and name.rsplit(".", 2)[-2] in LINEARS
            and not any(part in name.rpartition(".")[0] for part in float_modules)}


def fit_group_size(in_features: dict[str, int], requested: int) -> int:
    """A group size every linear's input features are a multiple of: `requested`, else the largest of its halvings
    down to 32 (the smallest group the tools and Pagoda take) that is. -1 (one group a row) fits any. Raises
    ValueError naming a linear no such group divides."""
    if requested == -1:
        return -1
    group = requested
    while any(k % group for k in in_features.values()):
        if group % 2 or group // 2 < 32:
            bad = min(name for name, k in in_features.items() if k % group)
            raise ValueError(f"group_size {requested}: {bad} has {in_features[bad]} input features, not a multiple "
                             f"of {requested} or of any halving of it down to 32")
        group //= 2
    return group


def read_tensors(src: str) -> dict[str, torch.Tensor]:
    """Every tensor of the float checkpoint `src` (one safetensors file or several shards)."""
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model {src!r}: no .safetensors file to quantize")
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        tensors.update(load_file(os.path.join(src, fname)))
    return tensors


def write_int4_checkpoint(src: str, dst: str, oracle_dst: str | None, fmt: Int4Format, seed: int = 0,
                          float_modules: tuple[str, ...] = ()) -> dict[str, Quantized]:
    """The checkpoint `src` (float safetensors, one file or shards) as `fmt` in `dst` (one model.safetensors, the
    other files copied: config.json with the `quantization_config`, the tokenizer), and its dequantized weights as
    a float32 checkpoint in `oracle_dst` (None: not written). Biases are stored fp16, as the tools store them (the
    oracle's rounded alike). Linear modules whose name contains one of `float_modules` are left as they are (a
    tool's ignore list). Every quantized linear's input features must be a multiple of the group size
    (`fit_group_size`). Returns each quantized linear module's quantization."""
    generator = torch.Generator().manual_seed(seed)
    tensors = read_tensors(src)
    if fmt.group_size != -1:
        misfit = {m: k for m, k in linear_in_features(tensors, float_modules).items() if k % fmt.group_size}
        if misfit:
            name = min(misfit)
            raise ValueError(f"group_size {fmt.group_size}: {name} has {misfit[name]} input features, not a "
                             "multiple of it (fit_group_size picks one that is)")
    packed, oracle, layers, orders = {}, {}, {}, {}
    for name in sorted(tensors):
        t = tensors[name]
        module, _, suffix = name.rpartition(".")
        if module.rsplit(".", 1)[-1] not in LINEARS or any(part in module for part in float_modules):
            packed[name] = oracle[name] = t
        elif suffix == "bias" and fmt.method != "pack-quantized":  # llm-compressor keeps the model's dtype
            packed[name], oracle[name] = t.half(), t.half().float()
        elif suffix == "bias":
            packed[name] = oracle[name] = t
        else:  # q/k/v and gate/up read the same input: one act-order for them
            same_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj",
                                                                                                 "gate_proj")
            same_input = same_input[:-3] + ".w1" if same_input.endswith(".w3") else same_input
            if same_input not in orders:
                orders[same_input] = torch.randperm(t.shape[1], generator=generator)
            qz = layers[module] = quantize(t, fmt, orders[same_input])
            parts = pack(qz, fmt)
            packed.update({f"{module}.{k}": v for k, v in parts.items()})
            oracle[name] = qz.dequantized()
    outputs = [(dst, packed, fmt.quantization_config())] + ([(oracle_dst, oracle, None)] if oracle_dst else [])
    for path, state, qc in outputs:
        os.makedirs(path, exist_ok=True)
        for fname in os.listdir(src):
            if not fname.endswith((".safetensors", ".safetensors.index.json")) and os.path.isfile(
                    os.path.join(src, fname)):
                shutil.copy(os.path.join(src, fname), path)
        save_file(state, os.path.join(path, "model.safetensors"))
        if qc is not None:
            set_quantization_config(path, qc)
        if qc is not None and fmt.method == "gptq":
            with open(os.path.join(path, "quantize_config.json"), "w") as f:
                json.dump(qc, f, indent=2)
    return layers


def set_quantization_config(model_dir: str, qc: dict) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
