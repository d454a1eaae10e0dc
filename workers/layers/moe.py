"""Mixture-of-experts layers: the router and the experts, tensor-parallel.

Every rank holds every expert, with each expert's intermediate dimension split across ranks as a Llama MLP is
(gate/up column-parallel, down row-parallel):

    w13 [E, 2 I / tp, H]   expert e: [its gate rows of this rank ; its up rows of this rank]
    w2  [E, H, I / tp]     expert e: its down columns of this rank

so `FusedMoE` returns this rank's partial sum and the block all-reduces once, after adding any shared expert's
partial sum. The router's weight is replicated: every rank routes every token the same way.

Checkpoints store one tensor per expert and projection (`experts.{e}.w1/w3/w2` in Mixtral, `experts.{e}.gate_proj/
up_proj/down_proj` in Qwen-MoE); `expert_param_name` maps them to (w13 / w2, shard id).

Built inside `quantized_layers(config)` with an AWQ / GPTQ / pack-quantized or FP8 config, the experts are held
quantized (workers/layers/moe_quant.py: packed integers or e4m3, stacked per projection, loaded per expert as
stored) and computed by kernels/moe_quant.py; the router (and a shared expert's gate) stay as the checkpoint gives
them. A GGUF file's experts (quantization="gguf") are built as placeholders on the meta device; workers/weights.py
`gguf_int_experts` then makes those whose file types the int kernels take (`make_experts`: a layer's gate and up of
one type, its down of that or another) int experts holding the file's blocks, and the others float ones that load
dequantized (checkpoints/gguf.py reads each of a stacked experts tensor's experts as its own slice).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization import QuantConfig
from kernels import ops
from kernels.moe import fused_moe, topk_route
from kernels.moe_quant import fused_moe_quant
from workers.layers.linear import _divide, _param, copy_loaded, default_weight_loader, loaded_shape
from workers.layers.moe_quant import create_fp8_experts, create_int_experts, finish_int_experts, quantized_experts
from workers.layers.quantization import current_quant_config
from workers.parallel import get_tp_rank, get_tp_size

# an expert's weight, or (quantized experts) its packed integers, zeros, scales, g_idx, or FP8 scales
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)"
                            r"\.(weight|qweight|qzeros|scales|g_idx|mins|weight_scale|input_scale)$")
_GATE_UP_INDEX = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


def expert_param_name(name: str) -> tuple[str, object] | None:
    """'...experts.3.w1.weight' -> ('...experts.w13_weight', (3, 0)); '...experts.3.down_proj.qweight' ->
    ('...experts.w2_qweight', 3); None for a tensor that is not one expert's projection."""
    match = _EXPERT_TENSOR.search(name)
    if match is None:
        return None
    expert, projection, tensor = int(match.group(1)), match.group(2), match.group(3)
    prefix = name[:match.start()] + ".experts."
    if projection in _GATE_UP_INDEX:
        return f"{prefix}w13_{tensor}", (expert, _GATE_UP_INDEX[projection])
    return f"{prefix}w2_{tensor}", expert


class Router(nn.Module):
    """hidden [T, H] -> (routing weights [T, top_k] in weights_dtype (float32, or the model's dtype where the model
    rounds them to it: Qwen), expert ids [T, top_k]); the weight is replicated."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, dtype=torch.float32,
                 device=None, weights_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.top_k, self.renormalize, self.weights_dtype = top_k, renormalize, weights_dtype
        self.weight = _param((num_experts, hidden_size), dtype, device, default_weight_loader)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # logits in the model dtype
        return topk_route(F.linear(h, self.weight), self.top_k, self.renormalize, self.weights_dtype)


class FusedMoE(nn.Module):
    """The experts of one layer (this rank's slice of each); forward returns this rank's partial sum."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype=torch.float32,
                 device=None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.inter_per_rank = _divide(intermediate_size, self.tp_size, "moe intermediate size")
        config = current_quant_config()
        self.quant_config = config if config is not None and config.method != "gguf" else None
        self.weights_device = device
        if self.quant_config is not None and self.quant_config.is_packed_int:
            create_int_experts(self, {"w13": self.quant_config, "w2": self.quant_config}, device)
        elif self.quant_config is not None:
            create_fp8_experts(self, self.quant_config, device)
        elif config is not None:  # GGUF: int or float as the file's types allow (`make_experts`), none held yet
            self._create_weights(dtype, "meta")
        else:
            self._create_weights(dtype, device)

    def make_experts(self, configs: dict[str, QuantConfig] | None) -> None:
        """A GGUF file's experts, before loading: int experts of w13's and w2's formats, or (None) float ones in
        the model's dtype, in place of the placeholders it was built with (so a file's experts never take their
        float size in memory first)."""
        dtype = self.w13_weight.dtype
        del self.w13_weight, self.w2_weight
        if configs is None:
            self._create_weights(dtype, self.weights_device)
            return
        self.quant_config = configs["w13"]
        create_int_experts(self, configs, self.weights_device)

    def finish_loading(self) -> None:
        """Once every expert has loaded (workers/weights.py): int experts' layout for the kernels."""
        if self.quant_config is not None and self.quant_config.is_packed_int:
            finish_int_experts(self)

    def _create_weights(self, dtype, device) -> None:
        num_experts, hidden_size = self.num_experts, self.hidden_size
        self.w13_weight = _param((num_experts, 2 * self.inter_per_rank, hidden_size), dtype, device,
                                 self._load_w13)
        self.w13_weight.shard_ids = [(e, j) for e in range(num_experts) for j in (0, 1)]
        self.w2_weight = _param((num_experts, hidden_size, self.inter_per_rank), dtype, device, self._load_w2)
        self.w2_weight.shard_ids = list(range(num_experts))

    def _check(self, loaded, expected: tuple[int, int], what: str) -> None:
        assert loaded_shape(loaded) == expected, f"{what}: expected {expected}, loaded {loaded_shape(loaded)}"

    def _load_w13(self, param: nn.Parameter, loaded, shard_id) -> None:
        expert, index = shard_id  # index 0: gate_proj / w1, 1: up_proj / w3
        self._check(loaded, (self.intermediate_size, self.hidden_size), f"expert {expert} gate/up")
        n, start = self.inter_per_rank, self.tp_rank * self.inter_per_rank
        copy_loaded(param.data[expert, index * n:(index + 1) * n], loaded[start:start + n])

    def _load_w2(self, param: nn.Parameter, loaded, shard_id) -> None:
        expert = shard_id
        self._check(loaded, (self.hidden_size, self.intermediate_size), f"expert {expert} down")
        n, start = self.inter_per_rank, self.tp_rank * self.inter_per_rank
        copy_loaded(param.data[expert], loaded[:, start:start + n])

    def forward(self, h: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # h: [T, H]; topk_*: [T, top_k] -> this rank's partial sum [T, H]
        if torch.compiler.is_compiling():  # the experts as an opaque op (kernels/ops.py)
            if self.quant_config is None:
                return ops.fused_moe(h, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
            w13, w2 = quantized_experts(self)
            if self.quant_config.is_packed_int:
                return ops.fused_moe_int(h, *ops.int_experts_args(w13), *ops.int_experts_args(w2), topk_weights,
                                         topk_ids)
            return ops.fused_moe_fp8(h, w13.weight, w13.scale, w2.weight, w2.scale,
                                     list(w13.block_size) if w13.block_size else None, topk_weights, topk_ids)
        if self.quant_config is not None:
            return fused_moe_quant(h, *quantized_experts(self), topk_weights, topk_ids)
        return fused_moe(h, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class ReplicatedLinear(nn.Module):
    """y = x @ W.T with the whole W on every rank (a small gate, e.g. Qwen2-MoE's shared_expert_gate)."""

    def __init__(self, in_features: int, out_features: int, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
