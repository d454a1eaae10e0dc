"""The Llama family over packed variable-length tokens and a paged KV cache: Llama 2/3 and Mistral here; the
other families (workers/models/qwen.py, phi3.py, moe.py) are this decoder with other attention options, MLPs
and checkpoint names.

Tokens of every sequence in the step are flattened into one dimension T (no batch dimension, no padding); the
attention metadata says where each sequence starts and where its KV history lives. Parameters are this rank's
tensor-parallel shard; q/k/v and gate/up are fused into one matmul each.

The order of operations follows Hugging Face transformers (residual adds in the model dtype, RMSNorm in float32
then cast, cos/sin in the model dtype), so float32 outputs match it to rounding.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from workers.kv_pool import KVLayout
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.models.args import ModelArgs

# (fused parameter, checkpoint name, shard id)
_STACKED_PARAMS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def sliding_windows(args: ModelArgs, is_sliding=None, use_by_default: bool = True) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers decides it: none without
    `sliding_window` or with `use_sliding_window` false (Qwen's switch; `use_by_default` where the config has
    none); else the config's `layer_types` where it has them (transformers 5), else `is_sliding(layer_idx)`, the
    family's rule (None: every layer)."""
    window = args.sliding_window
    use = use_by_default if args.use_sliding_window is None else args.use_sliding_window
    if not window or not use:
        return [None] * args.num_layers
    if args.layer_types:
        return [window if kind == "sliding_attention" else None for kind in args.layer_types]
    return [window if is_sliding is None or is_sliding(i) else None for i in range(args.num_layers)]


class LlamaAttentionBlock(nn.Module):
    """qkv projection, (Qwen3: RMSNorm of each q and k head), RoPE and the KV write, paged attention, o projection."""

    def __init__(self, args: ModelArgs, qkv_bias: bool, o_bias: bool, qk_norm: bool, sliding_window: int | None,
                 dtype, device, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden, num_heads, num_kv_heads, head_dim = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, qkv_bias, dtype, device)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, o_bias, dtype, device)
        self.rotary_emb = rotary_emb  # one cos/sin cache shared by every layer
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.head_dim = head_dim
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, args.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(head_dim, args.rms_norm_eps, dtype, device)
        self.qk_norm = qk_norm
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim ** -0.5, sliding_window,
                              device=device)

    @property
    def takes_quantized_rows(self) -> bool:
        return self.qkv_proj.takes_quantized_rows

    def forward(self, positions, h, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        # h: [T, hidden] (or QuantizedRows, see takes_quantized_rows) -> [T, hidden]
        qkv = self.qkv_proj(h, lora_slots=meta.lora_slots, lora_order=meta.lora_order)
        q, k, v = self.qkv_proj.split(qkv)  # [T, H*D], [T, H_kv*D] x2
        num_tokens = h.shape[0]
        compiling = torch.compiler.is_compiling()
        if self.qk_norm and compiling:  # over each head's head_dim: [T * H, D] rows (a copy of the strided slices)
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, H_kv, D]
        if compiling:  # the caches are CacheRefs (workers/compile.py)
            self.rotary_emb(positions, q, k)
            out = self.attn.compiled(q, k, v, k_cache, meta)
        else:  # the heads' norms (Qwen3), the rotation and the KV write: one kernel on a GPU, q and k in place
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
            self.rotary_emb.rotate_and_cache(positions, q, k, v, k_cache, v_cache, meta.slot_mapping,
                                             *self.attn.kv_scales(k_cache), qk_norm=qk_norm)
            out = self.attn(q, k_cache, v_cache, meta)  # [T, H*D]
        return self.o_proj(out, meta.lora_slots, meta.lora_order)


class LlamaMLP(nn.Module):
    """gate/up, SiLU-and-mul, down. reduce_results=False: down returns this rank's partial sum (a shared expert)."""

    def __init__(self, args: ModelArgs, bias: bool, dtype, device, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        hidden, inter = args.hidden_size, intermediate_size or args.intermediate_size
        if args.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {args.hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, dtype, device)
        self.down_proj = RowParallelLinear(inter, hidden, bias, dtype, device, reduce_results)

    @property
    def takes_quantized_rows(self) -> bool:
        return self.gate_up_proj.takes_quantized_rows

    def forward(self, h: torch.Tensor, lora_slots: torch.Tensor | None = None,
                lora_order: torch.Tensor | None = None) -> torch.Tensor:
        # h: [T, hidden] (or QuantizedRows, see takes_quantized_rows) -> silu(gate) * up [T, I / tp] (one kernel
        # for decode batches; quantized for an FP8 down_proj) -> [T, hidden]; lora_slots, lora_order: see
        # AttentionMetadata
        return self.down_proj(self.gate_up_proj(h, gated=True, quantize_output=self.down_proj.takes_quantized_rows,
                                                lora_slots=lora_slots, lora_order=lora_order),
                              lora_slots, lora_order)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, self_attn: LlamaAttentionBlock, mlp: nn.Module, dtype, device):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)

    def forward(self, positions, h, residual, k_cache, v_cache, meta):
        # h: [T, hidden]; residual: [T, hidden] | None (the residual stream before this layer's add). Before FP8
        # q/k/v and gate/up projections, the norms hand over their output quantized (no separate quantizing pass).
        quantize = self.self_attn.takes_quantized_rows
        if residual is None:
            residual, h = h, self.input_layernorm(h, quantize=quantize)
        else:
            h, residual = self.input_layernorm(h, residual, quantize)
        h = self.self_attn(positions, h, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual, self.mlp.takes_quantized_rows)
        return self.mlp(h, meta.lora_slots, meta.lora_order), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[LlamaDecoderLayer], dtype, device):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)

    def forward(self, input_ids, positions, kv_caches, meta):
        assert len(kv_caches) == len(self.layers), f"{len(kv_caches)} KV caches for {len(self.layers)} layers"
        h = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, residual = layer(positions, h, residual, k_cache, v_cache, meta)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral from a config.json's ModelArgs; this rank's shard of the weights.

    The other families subclass it and change what differs: `attention_biases`, `qk_norm`, `layer_windows`,
    `make_mlp`, `checkpoint_entries` (checkpoint tensor -> parameters), and DeepSeek's `make_attention` and
    `kv_layout`."""

    qk_norm = False  # RMSNorm over each q and k head before RoPE (Qwen3)

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, device=None,
                 max_model_len: int | None = None):
        super().__init__()
        self.args = args
        self.max_model_len = max_model_len or args.max_position_embeddings
        layers = [LlamaDecoderLayer(args, self.make_attention(args, i, dtype, device),
                                    self.make_mlp(args, i, dtype, device), dtype, device)
                  for i in range(args.num_layers)]
        self.tie_word_embeddings = args.tie_word_embeddings
        self.model = LlamaModel(args, layers, dtype, device)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, dtype, device)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    # ---- what the families change ----------------------------------------------------------------------------
    def make_attention(self, args: ModelArgs, layer_idx: int, dtype, device) -> nn.Module:
        """Layer layer_idx's attention block: forward(positions, h, k_cache, v_cache, meta) -> [T, hidden]."""
        window = self.layer_windows(args)[layer_idx]
        window = window if window is not None and window < self.max_model_len else None
        qkv_bias, o_bias = self.attention_biases(args)
        return LlamaAttentionBlock(args, qkv_bias, o_bias, self.qk_norm, window, dtype, device,
                                   self.shared_rotary_emb(args, dtype, device))

    def shared_rotary_emb(self, args: ModelArgs, dtype, device) -> RotaryEmbedding:
        """One cos/sin cache for every layer, covering every position the engine may ask for."""
        if not hasattr(self, "rotary_emb"):
            trained_len = args.max_position_embeddings
            self.rotary_emb = RotaryEmbedding(args.head_dim, max(trained_len, self.max_model_len), args.rope_theta,
                                              args.rope_scaling, dtype, device, max_position_embeddings=trained_len,
                                              max_model_len=self.max_model_len)
        return self.rotary_emb

    @staticmethod
    def attention_biases(args: ModelArgs) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias)."""
        return args.attention_bias, args.attention_bias

    @staticmethod
    def layer_windows(args: ModelArgs) -> list[int | None]:
        """Each layer's sliding window (None: full attention): here every layer's, when `sliding_window` is set."""
        return sliding_windows(args)

    def make_mlp(self, args: ModelArgs, layer_idx: int, dtype, device) -> nn.Module:
        return LlamaMLP(args, args.mlp_bias, dtype, device)

    def checkpoint_entries(self, name: str, loaded) -> Iterator[tuple[str, object, object]]:
        """(parameter name, tensor or slice, shard id) for one checkpoint tensor: q/k/v and gate/up go to their
        fused parameters."""
        for fused, original, shard_id in _STACKED_PARAMS:
            if f".{original}." in name:
                yield name.replace(f".{original}.", f".{fused}."), loaded, shard_id
                return
        yield name, loaded, None

    # ---- the model runner's interface ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def kv_layout(self) -> KVLayout:
        """What each layer's pool holds per token on this rank: per-head K and V."""
        return KVLayout.per_head(self.num_layers, self.num_kv_heads_per_rank, self.head_dim)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    @property
    def vocab_size(self) -> int:
        return self.lm_head.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden] (after the final norm)
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, hidden] -> float32 logits [N, vocab] on TP rank 0; None on the other ranks
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Loads (Hugging Face name, safetensors slice or tensor) pairs; every parameter must be covered.

        Returns the names of the parameters loaded."""
        params = dict(self.named_parameters())
        loaded_shards: set[tuple[str, object]] = set()
        for checkpoint_name, checkpoint_tensor in weights:
            if "rotary_emb.inv_freq" in checkpoint_name or (self.tie_word_embeddings
                                                              and checkpoint_name == "lm_head.weight"):
                continue
            for name, loaded, shard_id in self.checkpoint_entries(checkpoint_name, checkpoint_tensor):
                if name not in params:
                    raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no parameter in {type(self).__name__}")
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, loaded, shard_id)
                loaded_shards.add((name, shard_id))
        expected = {(name, shard_id) for name, param in params.items() for shard_id in _shard_ids(name, param)}
        missing = sorted(f"{name}[{shard}]" if shard is not None else name
                         for name, shard in expected - loaded_shards)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return {name for name, _ in loaded_shards}


def _shard_ids(param_name: str, param: nn.Parameter) -> list:
    """The shard ids a parameter is loaded from: its own `shard_ids` (stacked experts), e.g. ["q", "k", "v"] for
    qkv_proj, [None] for a plain one."""
    if hasattr(param, "shard_ids"):
        return list(param.shard_ids)
    fused_ids = [shard_id for fused, _, shard_id in _STACKED_PARAMS if f".{fused}." in param_name]
    return fused_ids or [None]
