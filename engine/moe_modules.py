"""The linear modules of a mixture-of-experts checkpoint that Pagoda's quantized layers hold (pure Python, from
config.json): the engine checks a quantized checkpoint's ignore list against them before any worker starts.

A quantized MoE checkpoint names what its tool left unquantized: routers and Qwen2-MoE's shared_expert_gate (which
Pagoda always keeps in the model's dtype), norms, the LM head (transformers' FP8 checkpoints list each layer's, e.g.
Qwen3-30B-A3B-FP8's `model.layers.0.mlp.gate`), and a shared expert as a whole (its gate, up and down projections
all named: Pagoda then builds that shared expert unquantized, workers/models/moe.py). An entry that names one of
these modules instead (an attention projection, an expert, a dense MLP, a part of a shared expert) would leave a
module in float that Pagoda reads as quantized: refused.

The layout restates workers/models/moe.py's and deepseek_v2.py's (which the engine may not import): every layer's
q/k/v/o projections (DeepSeek-V2's latent attention: q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
o_proj), then Mixtral's experts `block_sparse_moe.experts.{e}.w1/w2/w3`, or Qwen-MoE's and DeepSeek's
`mlp.experts.{e}.gate_proj/up_proj/down_proj` (plus Qwen2-MoE's `mlp.shared_expert.*` when
shared_expert_intermediate_size, DeepSeek's `mlp.shared_experts.*` when n_shared_experts) in its sparse layers and
`mlp.gate_proj/up_proj/down_proj` in the others (`mlp_only_layers`, `decoder_sparse_step`; DeepSeek's
`first_k_dense_replace`, `moe_layer_freq`).
"""

from __future__ import annotations

import re

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def moe_linear_modules(hf_config: dict) -> list[str]:
    """The checkpoint names of the decoder's linear modules Pagoda quantizes, for a Mixtral / Qwen-MoE / DeepSeek-V2
    config."""
    names: list[str] = []
    mixtral_experts = hf_config.get("num_local_experts")
    is_deepseek = hf_config.get("kv_lora_rank") is not None
    num_experts = mixtral_experts or hf_config.get("num_experts") or hf_config.get("n_routed_experts") or 0
    for i in range(hf_config.get("num_hidden_layers") or 0):
        layer = f"model.layers.{i}"
        names += [f"{layer}.self_attn.{p}" for p in (_latent_attention(hf_config) if is_deepseek else _ATTENTION)]
        if mixtral_experts:
            names += [f"{layer}.block_sparse_moe.experts.{e}.{w}" for e in range(num_experts)
                      for w in ("w1", "w2", "w3")]
        elif num_experts > 0 and _is_sparse(hf_config, i, is_deepseek):
            names += [f"{layer}.mlp.experts.{e}.{p}" for e in range(num_experts) for p in _MLP]
            if hf_config.get("shared_expert_intermediate_size"):
                names += [f"{layer}.mlp.shared_expert.{p}" for p in _MLP]
            if is_deepseek and hf_config.get("n_shared_experts"):
                names += [f"{layer}.mlp.shared_experts.{p}" for p in _MLP]
        else:
            names += [f"{layer}.mlp.{p}" for p in _MLP]
    return names


def _latent_attention(hf_config: dict) -> tuple[str, ...]:
    q = ("q_proj",) if hf_config.get("q_lora_rank") is None else ("q_a_proj", "q_b_proj")
    return q + ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _is_sparse(hf_config: dict, i: int, is_deepseek: bool) -> bool:
    """Whether layer i routes to experts: Qwen-MoE's mlp_only_layers / decoder_sparse_step, DeepSeek's
    first_k_dense_replace / moe_layer_freq."""
    if is_deepseek:
        return i >= (hf_config.get("first_k_dense_replace") or 0) and i % (hf_config.get("moe_layer_freq") or 1) == 0
    step = hf_config.get("decoder_sparse_step") or 1
    return i not in set(hf_config.get("mlp_only_layers") or ()) and (i + 1) % step == 0


def first_ignored_module(patterns: tuple[str, ...], hf_config: dict, substring: bool) -> tuple[str, str] | None:
    """(pattern, module) for the first ignore-list entry that names a module Pagoda quantizes (a shared expert's
    projection counts only when the list leaves part of that shared expert quantized), or None.

    An entry names a module as QuantConfig.is_ignored reads it (the whole name, a trailing part of it at a dot, or
    a "re:" pattern matching all of it), or with `substring` (AWQ: AutoAWQ, transformers and vLLM skip every module
    whose name contains an entry, so AutoAWQ's Qwen2-MoE entry "gate" also leaves each `gate_proj` in float)."""
    if not patterns:
        return None
    names = moe_linear_modules(hf_config)
    tails: dict[str, list[str]] = {}  # every dot-suffix of every name (the name itself included) -> those names
    for name in names:
        parts = name.split(".")
        for i in range(len(parts)):
            tails.setdefault(".".join(parts[i:]), []).append(name)
    hits: dict[str, str] = {}  # module -> the first pattern naming it
    for pattern in patterns:
        if pattern.startswith("re:"):
            regex = re.compile(pattern[3:])
            named = [name for name in names if regex.fullmatch(name)]
        elif substring:
            named = [name for name in names if pattern in name]
        else:
            named = tails.get(pattern, [])
        for name in named:
            hits.setdefault(name, pattern)
    for name, pattern in hits.items():
        shared, _, _ = name.rpartition(".")
        if shared.endswith(".mlp.shared_expert") and all(f"{shared}.{p}" in hits for p in _MLP):
            continue  # a whole shared expert in float: built unquantized
        return pattern, name
    return None
