"""ModelArgs: the fields of a Hugging Face config.json that the model code reads, read once, typed.

Defaults are the ones transformers applies when a field is absent; derived values (head_dim, the KV heads, RoPE's
theta and scaling) are derived here and nowhere else. A required field that is missing is a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

_ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")  # the types that read original_max_position_embeddings


@dataclass(frozen=True)
class MLAArgs:
    """DeepSeek's multi-head latent attention: queries through an optional low-rank q_lora_rank (None: one q_proj),
    keys and values from one kv_lora_rank latent a token; each head's query and key are qk_nope_head_dim values
    without position and qk_rope_head_dim rotated ones (the rotated key is one for every head), its value
    v_head_dim values."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> MLAArgs | None:
        if not cfg.get("kv_lora_rank"):
            return None
        return cls(q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
                   kv_lora_rank=_required(cfg, "kv_lora_rank"), qk_nope_head_dim=_required(cfg, "qk_nope_head_dim"),
                   qk_rope_head_dim=_required(cfg, "qk_rope_head_dim"), v_head_dim=_required(cfg, "v_head_dim"))


_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class ModelArgs:
    """What the model code knows of a checkpoint's config.json (`from_hf_config`); every layer reads this one."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int  # the length the checkpoint was trained on
    rope_theta: float
    rope_scaling: dict | None  # None: plain RoPE (see rope_settings)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = True  # Qwen2-MoE's switch for its q/k/v biases
    # Sliding windows (each family's rule: workers/models/llama.py sliding_windows)
    sliding_window: int | None = None
    use_sliding_window: bool | None = None  # Qwen's switch; None where the config has none
    layer_types: tuple[str, ...] | None = None  # transformers 5: "sliding_attention" / "full_attention" per layer
    max_window_layers: int = 0
    # Mixture of experts (num_experts 0: a dense model)
    num_experts: int = 0  # Qwen-MoE's num_experts or Mixtral's num_local_experts
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # Qwen-MoE's experts (Mixtral's are intermediate_size wide)
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek-V2: latent attention, shared experts (n_shared_experts x moe_intermediate_size wide), routing limited
    # to the topk_group best of n_group expert groups, and dense layers before first_k_dense_replace
    mla: MLAArgs | None = None
    n_shared_experts: int = 0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        hidden, num_heads = _required(cfg, "hidden_size"), _required(cfg, "num_attention_heads")
        theta, scaling = rope_settings(cfg)
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        _check_routing(cfg)
        layer_types = cfg.get("layer_types")
        return cls(
            hidden_size=hidden,
            intermediate_size=_required(cfg, "intermediate_size"),
            num_layers=_required(cfg, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            vocab_size=_required(cfg, "vocab_size"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=cfg.get("hidden_act", "silu"),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qkv_bias=bool(cfg.get("qkv_bias", True)),
            sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
            use_sliding_window=cfg.get("use_sliding_window"),
            layer_types=tuple(layer_types) if layer_types else None,
            max_window_layers=int(cfg.get("max_window_layers", 0)),
            num_experts=num_experts,
            num_experts_per_tok=_required(cfg, "num_experts_per_tok") if num_experts else 0,
            # Qwen-MoE counts its experts in num_experts, each moe_intermediate_size wide (Mixtral's in
            # num_local_experts, each intermediate_size wide)
            moe_intermediate_size=(_required(cfg, "moe_intermediate_size") if cfg.get("num_experts")
                                   else cfg.get("moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers", ())),
            mla=MLAArgs.from_hf_config(cfg),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            topk_method=cfg.get("topk_method") or "greedy",
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
        )


def _check_routing(cfg: dict) -> None:
    """DeepSeek's routing options that Pagoda does not implement are refused, naming the field."""
    method = cfg.get("topk_method") or "greedy"
    if method not in _TOPK_METHODS:
        raise ValueError(f"config.json topk_method {method!r} is not supported (supported: {', '.join(_TOPK_METHODS)})")
    scoring = cfg.get("scoring_func") or "softmax"
    if scoring != "softmax":
        raise ValueError(f"config.json scoring_func {scoring!r} is not supported (only 'softmax')")


def _required(cfg: dict, name: str) -> int:
    if cfg.get(name) is None:
        raise ValueError(f"config.json has no {name!r}, which the model needs")
    return int(cfg[name])


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json of either transformers 4 (`rope_theta`, `rope_scaling`)
    or transformers 5 (`rope_parameters`). rope_scaling is None for plain RoPE, else a dict with `rope_type` and,
    for the types that use it, `original_max_position_embeddings` resolved as transformers' config resolves it
    (a top-level field first, as Phi-3 has; else the scaling's own; else max_position_embeddings)."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params)
    partial = scaling.pop("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise NotImplementedError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if cfg.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # what transformers' Phi3Config reads these old names as
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type in _ORIGINAL_LEN_TYPES:
        if "original_max_position_embeddings" in cfg:
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return theta, scaling
