"""DeepSeek-V2 (and V2-Lite): the Llama decoder with multi-head latent attention (workers/layers/mla.py) over a
latent KV pool, and a mixture of experts with shared experts and group-limited routing.

    layers < first_k_dense_replace (and those not a multiple of moe_layer_freq): a dense SiLU MLP
    the others: routed experts (top num_experts_per_tok of n_routed_experts, each moe_intermediate_size wide)
                + shared experts (one MLP n_shared_experts x moe_intermediate_size wide), added unweighted

Routing (`DeepseekRouter`, as DeepSeek's own modeling code and transformers): softmax over the experts in float32
from a float32 router weight; with topk_method "group_limited_greedy" only the experts of the topk_group groups
(of n_group) with the highest best score compete; the top-k scores are the weights, renormalized to sum 1 when
norm_topk_prob (and top_k > 1), else scaled by routed_scaling_factor. The fused MoE kernel then takes the ids and
weights as for Mixtral and Qwen (workers/layers/moe.py).

Tensor parallelism: attention heads split (mla.py; the latent pool replicated), each expert's intermediate dimension
split as Pagoda's other MoE models, the shared experts' as a dense MLP's; one all-reduce per MoE block.

quantization="fp8" (online): FP8 q_proj / q_b_proj, o_proj, dense MLPs and shared experts, and FP8 routed
experts (workers/layers/moe_quant.py, as Mixtral's); the router, q_a_proj, kv_a_proj_with_mqa and kv_b_proj stay in
the model's dtype. Int and FP8 checkpoints are refused by the engine (engine/quantization.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import topk_route
from workers.kv_pool import KVLayout
from workers.layers.linear import _param, default_weight_loader
from workers.layers.mla import MLAAttentionBlock
from workers.layers.moe import FusedMoE
from workers.layers.rotary import InterleavedRotaryEmbedding
from workers.models.args import ModelArgs
from workers.models.llama import LlamaForCausalLM, LlamaMLP
from workers.models.moe import moe_checkpoint_entries
from workers.parallel import all_reduce
from workers.side_stream import beside


class DeepseekRouter(nn.Module):
    """h [T, H] -> (weights float32 [T, top_k], expert ids [T, top_k]); the float32 weight is replicated."""

    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.is_group_limited = args.topk_method == "group_limited_greedy"
        self.n_group, self.topk_group = args.n_group, args.topk_group
        if self.is_group_limited:
            if num_experts % args.n_group or not 1 <= args.topk_group <= args.n_group:
                raise ValueError(f"config.json n_group {args.n_group} must divide n_routed_experts {num_experts} and "
                                 f"topk_group {args.topk_group} be in [1, n_group]")
            if self.top_k > args.topk_group * num_experts // args.n_group:
                raise ValueError(f"config.json num_experts_per_tok {self.top_k} exceeds the experts of topk_group "
                                 f"{args.topk_group} groups")
        self.renormalize = args.norm_topk_prob and self.top_k > 1
        self.routed_scaling_factor = args.routed_scaling_factor
        self.weight = _param((num_experts, args.hidden_size), torch.float32, device, default_weight_loader)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # softmax of the float32 logits, group-limited greedy when asked, the top_k, renormalized (with
        # transformers' 1e-20) or scaled: kernels/moe.py topk_route (one kernel on a GPU)
        return topk_route(F.linear(h.float(), self.weight), self.top_k, self.renormalize,
                          scale=self.routed_scaling_factor, renorm_eps=1e-20,
                          groups=(self.n_group, self.topk_group) if self.is_group_limited else None)


class DeepseekV2MoE(nn.Module):
    """h [T, hidden] -> the routed experts' weighted sum + the shared experts, all-reduced once."""

    takes_quantized_rows = False  # the router and the experts read h in the model's dtype

    def __init__(self, args: ModelArgs, dtype, device):
        super().__init__()
        if args.moe_intermediate_size is None:
            raise ValueError("config.json has no 'moe_intermediate_size', which the model needs")
        self.gate = DeepseekRouter(args, device)
        self.experts = FusedMoE(args.num_experts, args.hidden_size, args.moe_intermediate_size, dtype, device)
        self.shared_experts = None
        if args.n_shared_experts:
            self.shared_experts = LlamaMLP(args, False, dtype, device,
                                           args.moe_intermediate_size * args.n_shared_experts, reduce_results=False)

    def forward(self, h: torch.Tensor, lora_slots: torch.Tensor | None = None,
                lora_order: torch.Tensor | None = None) -> torch.Tensor:
        # lora_slots, lora_order: unused (engine/lora.py: adapters on DeepSeek-V2's attention only; the decoder layer
        # passes them to any MLP)
        if self.shared_experts is None:
            return all_reduce(self.experts(h, *self.gate(h)))  # this rank's partial sum [T, hidden], all-reduced
        # in a decode graph the shared experts run beside the router and the routed ones (workers/side_stream.py)
        shared, out = beside(lambda: self.shared_experts(h), lambda: self.experts(h, *self.gate(h)), h.device)
        return all_reduce(out + shared)


def is_moe_layer(args: ModelArgs, layer_idx: int) -> bool:
    """DeepSeek's rule: routed experts from first_k_dense_replace on, in every moe_layer_freq-th layer."""
    return args.num_experts > 0 and layer_idx >= args.first_k_dense_replace and layer_idx % args.moe_layer_freq == 0


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, device=None,
                 max_model_len: int | None = None):
        if args.mla is None:
            raise ValueError("config.json has no 'kv_lora_rank', which DeepseekV2ForCausalLM needs")
        super().__init__(args, dtype, device, max_model_len)

    def make_attention(self, args: ModelArgs, layer_idx: int, dtype, device) -> nn.Module:
        return MLAAttentionBlock(args, dtype, device, self.shared_rotary_emb(args, dtype, device))

    def shared_rotary_emb(self, args: ModelArgs, dtype, device) -> InterleavedRotaryEmbedding:  # type: ignore[override]
        if not hasattr(self, "rotary_emb"):
            assert args.mla is not None
            trained_len, max_len = args.max_position_embeddings, self.max_model_len
            self.rotary_emb = InterleavedRotaryEmbedding(args.mla.qk_rope_head_dim, max(trained_len, max_len),
                                                         args.rope_theta, args.rope_scaling, device,
                                                         max_position_embeddings=trained_len, max_model_len=max_len)
        return self.rotary_emb

    def make_mlp(self, args: ModelArgs, layer_idx: int, dtype, device) -> nn.Module:
        if is_moe_layer(args, layer_idx):
            return DeepseekV2MoE(args, dtype, device)
        return LlamaMLP(args, False, dtype, device)

    def checkpoint_entries(self, name: str, loaded):
        if ".self_attn." in name:  # MLA's projections load as they are named (no fused q/k/v)
            yield name, loaded, None
            return
        yield from moe_checkpoint_entries(super().checkpoint_entries, name, loaded)

    @property
    def kv_layout(self) -> KVLayout:
        """A latent pool: kv_lora_rank + qk_rope_head_dim values a token and layer, the same on every rank."""
        mla = self.args.mla
        assert mla is not None
        return KVLayout.latent(self.num_layers, mla.kv_lora_rank, mla.qk_rope_head_dim)
