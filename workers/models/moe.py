"""Mixture-of-experts families: Mixtral, Qwen2-MoE and Qwen3-MoE, the Llama / Qwen decoders whose MLP is a sparse
MoE block in every layer (Qwen: except `mlp_only_layers`, and only every `decoder_sparse_step`-th layer).

    Mixtral     router softmax -> top-k, renormalized (float32 weights); experts w1 (gate), w3 (up), w2 (down)
    Qwen2-MoE   router top-k, renormalized with norm_topk_prob; plus a shared expert scaled by
                sigmoid(shared_expert_gate(x)); q/k/v biases
    Qwen3-MoE   router top-k, renormalized with norm_topk_prob; Qwen3's attention (q/k head norms)

Tensor parallelism: each expert's intermediate dimension is split across the ranks (workers/layers/moe.py), the
shared expert's as a dense MLP's, and the block all-reduces once, after adding the two partial sums.

Quantized checkpoints: the routed experts and a shared expert are quantized as the checkpoint stores them; a shared
expert its quantization_config leaves whole in float (its gate, up and down all ignored) is built unquantized.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from workers.layers.moe import FusedMoE, ReplicatedLinear, Router, expert_param_name
from workers.layers.quantization import current_quant_config, quantized_layers
from workers.models.args import ModelArgs
from workers.models.llama import LlamaForCausalLM, LlamaMLP, sliding_windows
from workers.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from workers.parallel import all_reduce
from workers.side_stream import beside


class SparseMoeBlock(nn.Module):
    """h [T, hidden] -> the routed experts' weighted sum (+ the gated shared expert), all-reduced once."""

    takes_quantized_rows = False  # the router and the experts read h in the model's dtype

    def __init__(self, args: ModelArgs, intermediate_size: int, renormalize: bool, round_weights: bool,
                 shared_intermediate_size: int, dtype, device, shared_prefix: str | None = None):
        super().__init__()
        if not args.num_experts:
            raise ValueError("config.json has neither 'num_experts' nor 'num_local_experts', which the model needs")
        hidden = args.hidden_size
        # Qwen casts the routing weights to the model dtype, Mixtral does not
        self.gate = Router(hidden, args.num_experts, args.num_experts_per_tok, renormalize, dtype, device,
                           weights_dtype=dtype if round_weights else torch.float32)
        self.experts = FusedMoE(args.num_experts, hidden, intermediate_size, dtype, device)
        self.shared_expert = None
        if shared_intermediate_size:
            config = current_quant_config()
            if config is not None and shared_prefix is not None and all(
                    config.is_ignored(f"{shared_prefix}.{p}") for p in ("gate_proj", "up_proj", "down_proj")):
                config = None  # left in float by the checkpoint's tool
            with quantized_layers(config):
                self.shared_expert = LlamaMLP(args, False, dtype, device, shared_intermediate_size,
                                              reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype, device)

    def forward(self, h: torch.Tensor, lora_slots: torch.Tensor | None = None,
                lora_order: torch.Tensor | None = None) -> torch.Tensor:
        # lora_slots, lora_order: unused, the experts take no adapter (engine/lora.py: attention only on MoE families)
        if self.shared_expert is None:
            return all_reduce(self._routed(h))
        # in a decode graph the gated shared expert runs beside the router and the experts (workers/side_stream.py)
        shared, out = beside(lambda: torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h),
                             lambda: self._routed(h), h.device)
        return all_reduce(out + shared)

    def _routed(self, h: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum: this rank's partial sum [T, hidden]."""
        topk_weights, topk_ids = self.gate(h)  # [T, top_k] each
        return self.experts(h, topk_weights, topk_ids)


def moe_checkpoint_entries(dense_entries, name: str, loaded) -> Iterator[tuple[str, object, object]]:
    """One expert's projection -> the stacked expert parameter and its shard id; anything else as the dense
    model maps it (`dense_entries`)."""
    expert = expert_param_name(name)
    if expert is not None:
        yield expert[0], loaded, expert[1]
    else:
        yield from dense_entries(name, loaded)


def _qwen_moe_mlp(args: ModelArgs, layer_idx: int, shared_intermediate_size: int, dtype, device) -> nn.Module:
    is_sparse = (layer_idx not in args.mlp_only_layers and args.num_experts > 0
                 and (layer_idx + 1) % args.decoder_sparse_step == 0)
    if not is_sparse:
        return LlamaMLP(args, False, dtype, device)
    return SparseMoeBlock(args, args.moe_intermediate_size, args.norm_topk_prob, True, shared_intermediate_size,
                          dtype, device, shared_prefix=f"model.layers.{layer_idx}.mlp.shared_expert")


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, args: ModelArgs, layer_idx: int, dtype, device) -> nn.Module:
        return SparseMoeBlock(args, args.intermediate_size, True, False, 0, dtype, device)

    def checkpoint_entries(self, name: str, loaded):
        # The checkpoint's block_sparse_moe is this model's mlp.
        return moe_checkpoint_entries(super().checkpoint_entries, name.replace(".block_sparse_moe.", ".mlp."), loaded)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @staticmethod
    def attention_biases(args: ModelArgs) -> tuple[bool, bool]:
        return args.qkv_bias, False

    @staticmethod
    def layer_windows(args: ModelArgs) -> list[int | None]:
        # transformers' Qwen2MoeConfig: the even-indexed layers below max_window_layers
        return sliding_windows(args, lambda i: (i + 1) % 2 == 1 and i < args.max_window_layers, use_by_default=False)

    def make_mlp(self, args: ModelArgs, layer_idx: int, dtype, device) -> nn.Module:
        return _qwen_moe_mlp(args, layer_idx, args.shared_expert_intermediate_size, dtype, device)

    def checkpoint_entries(self, name: str, loaded):
        return moe_checkpoint_entries(super().checkpoint_entries, name, loaded)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def layer_windows(args: ModelArgs) -> list[int | None]:
        return sliding_windows(args, use_by_default=False)  # every layer, with use_sliding_window

    def make_mlp(self, args: ModelArgs, layer_idx: int, dtype, device) -> nn.Module:
        return _qwen_moe_mlp(args, layer_idx, 0, dtype, device)

    def checkpoint_entries(self, name: str, loaded):
        return moe_checkpoint_entries(super().checkpoint_entries, name, loaded)
