"""Which scheme a model's linear layers use (FP8, or AWQ / GPTQ integers): from the user's `quantization` and the
checkpoint's `quantization_config` (pure Python: the engine validates it before any worker starts).

    quantization="fp8" on a bf16/fp16/fp32 checkpoint   online: each rank quantizes its shard at load,
                                                         per output channel, activations per token
    quant_method "fp8" (transformers' FineGrainedFP8 / FP8 checkpoints)
        weight_block_size [bn, bk]: block scales `weight_scale_inv` [N / bn, K / bk]; none: one per tensor
        activation_scheme "dynamic" (per token here) or "static" (`input_scale` per tensor)
    quant_method "compressed-tensors", format "float-quantized" (llm-compressor's FP8 checkpoints)
        weights strategy "channel" (`weight_scale` [N, 1]) or "tensor"; input_activations dynamic "token"
        or static "tensor" (`input_scale`)

Weight-only integer checkpoints, read as stored (workers/layers/quantization_int.py; activations stay in the
model's dtype):
    quant_method "awq", version "gemm" (AutoAWQ): 4 bits, zero_point true, group_size 32 / 64 / 128
    quant_method "gptq" (AutoGPTQ / GPTQModel, checkpoint_format "gptq", the v1 packing, or GPTQModel's
        "gptq_v2", zero points stored without v1's minus one; pack_dtype int32): bits 4 or 8, sym true or false,
        desc_act with g_idx or not, group_size 32 / 64 / 128 or -1 (one group over all of K)
    quant_method "compressed-tensors", format "pack-quantized" (llm-compressor's W4A16 / W8A16; method
        "pack-quantized" here): one config group, weights type "int", num_bits 4 or 8, symmetric (no zero points)
        or not (`weight_zero_point`), strategy "group" (32 / 64 / 128) or "channel", actorder "group" with
        `weight_g_idx` or none; no input_activations

With random weights (load_format "random", a `--preset`) and no quantization_config, quantization="awq" or "gptq"
takes a default config (RANDOM_INT_CONFIGS: AWQ 4 bits, group 128, zero points; GPTQ 4 bits, group 128, symmetric,
no act-order; the group halved where a linear's input features need it) and the int layers draw their integers
packed: benchmarks of real-sized int4 models without a checkpoint. A checkpoint's own weights without a
quantization_config are never quantized to int at load.

quantization="gguf" on a .gguf model: decoder linears stored Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K are
served from their own blocks, each group of 32 (Q6_K: 16) weights a group of an int layer of their type
(checkpoints/gguf_types.py: 4 bits, or 8 holding 5- and 6-bit values; a zero point or an additive minimum; fp16 or
float32 scales; checkpoints/gguf_blocks.py repacks them exactly); linears of another type (F16, Q2_K, Q3_K, ...),
and fused q/k/v or gate/up whose parts differ in type, are dequantized at load as without it (a warning says so),
as are the routed experts of an MoE layer whose gate and up differ in type, or whose types the int kernels do not
take; the others are served from their blocks by the fused MoE kernel, gate/up and down each of its own type
(workers/weights.py `gguf_int_experts`); shared experts are linears.
Without it (None, or "none") a GGUF file is dequantized at load; EngineArgs gives a .gguf model on a GPU
quantization="gguf" unless told otherwise (engine/config.py).

Everything else (other int methods and versions, weight-only FP8, other formats) is a ValueError that names what
is not supported: a checkpoint is never loaded as if it were unquantized.

Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): the routed experts are quantized as the other linears
are (workers/layers/moe_quant.py, kernels/moe_quant.py): an AWQ / GPTQ / pack-quantized checkpoint's experts as
stored, and FP8 ones, online (quantization="fp8", a scale per output row) or from an FP8 checkpoint (per row,
tensor or block); FP8 experts quantize their inputs per token (W8A8, as the FP8 linears: kernels/moe_quant.py), or,
in a checkpoint with static input scales, by one scale a projection for all of a layer's experts (the largest of
theirs, as vLLM does). Routers and Qwen2-MoE's shared_expert_gate stay as the
checkpoint gives them (unquantized); an ignore list may name those, norms and the LM head, and nothing Pagoda
quantizes (engine/moe_modules.py).

DeepSeek-V2 (multi-head latent attention, config.json kv_lora_rank): quantization="fp8" on its unquantized checkpoint
(its routed experts FP8 as above; kv_b_proj, q_a_proj, kv_a_proj_with_mqa and the router in the model's dtype), and
its int and FP8 checkpoints as stored (every projection quantized: q_a_proj and kv_a_proj_with_mqa replicated,
kv_b_proj dequantized at load into the absorbed W_UK / W_UV, workers/layers/mla.py; routed and shared experts as
the other MoE families'). Its GGUF files are not served as int blocks.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from checkpoints.gguf_types import INT_LAYOUTS as GGUF_INT_LAYOUTS
from engine.errors import ParamError
from engine.moe_modules import first_ignored_module

logger = logging.getLogger(__name__)

QUANTIZATIONS = (None, "none", "fp8", "awq", "gptq", "gguf")  # "awq" / "gptq" only name the checkpoint's own method
INT_METHODS = ("awq", "gptq", "pack-quantized", "gguf")
INT_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8")
# quantization="awq" / "gptq" with random weights and no quantization_config (`--preset llama-3-8b --quantization
# awq`): the layout most hub checkpoints have, as the tools write it; the int layers draw their integers packed
RANDOM_INT_CONFIGS: dict[str, dict] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"},
}


@dataclass(frozen=True)
class QuantConfig:
    """FP8 linear layers. weight: "channel" (a scale per output row; per-tensor checkpoints are expanded to it)
    or "block" (`block_size` = (rows, cols) per scale); activation: "dynamic" (per token, at run time) or
    "static" (a per-tensor `input_scale` from the checkpoint). `ignored`: module name prefixes left unquantized.

    Or weight-only integers (method "awq" / "gptq" / "pack-quantized", `is_packed_int`): `bits` per weight packed
    in int32, a scale and a zero point per group of `group_size` input features (None: one group over all of
    them), `desc_act`: act-order, each input feature's group read from the checkpoint's g_idx;
    `has_zero_points` False: a symmetric checkpoint stores none (the zero is 2^(bits - 1) of the stored unsigned
    integers); `has_mins`: GGUF's additive minimum per group instead (w = q * scale + min); `scale_dtype`: the
    scales' (and minimums') dtype, "float32" where fp16 would round them (compressed-tensors' bf16, GGUF k-quants'
    products)."""

    method: str  # "fp8" (online, or an FP8 checkpoint) | "compressed-tensors" | "awq" | "gptq" | "pack-quantized"
    is_checkpoint_fp8: bool  # the checkpoint stores float8 weights and their scales
    weight: str = "channel"
    block_size: tuple[int, int] | None = None
    activation: str = "dynamic"
    scale_name: str = "weight_scale"  # the checkpoint's name for the weight scales ("weight_scale_inv" in HF fp8)
    ignored: tuple[str, ...] = ()
    bits: int = 8
    group_size: int | None = None
    desc_act: bool = False
    has_zero_points: bool = True
    has_mins: bool = False
    scale_dtype: str = "float16"
    checkpoint_format: str | None = None  # GPTQ's: "gptq" (v1: zero points stored minus one) or "gptq_v2"

    @property
    def is_packed_int(self) -> bool:
        """Weight-only integers packed in int32 (AWQ, GPTQ, compressed-tensors), dequantized in the matmul."""
        return self.method in INT_METHODS

    @property
    def pack_factor(self) -> int:
        """Weights per int32."""
        return 32 // self.bits

    @property
    def ignores_substrings(self) -> bool:
        """AWQ's modules_to_not_convert entries name every module whose name contains them (AutoAWQ, transformers
        and vLLM match them so)."""
        return self.method == "awq"

    def is_ignored(self, module_name: str) -> bool:
        """Whether the checkpoint left `module_name` (e.g. "model.layers.0.mlp.down_proj") unquantized: a listed
        name, a name it ends with, or a "re:" pattern (compressed-tensors); for AWQ, any name containing an entry."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return True
            elif self.ignores_substrings and pattern in module_name:
                return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False


def resolve_quantization(quantization: str | None, hf_config: dict,
                         is_random_weights: bool = False) -> QuantConfig | None:
    """The scheme for this checkpoint and the user's `quantization` (QUANTIZATIONS); ValueError if unsupported.
    `is_random_weights` (load_format "random", a preset): "awq" / "gptq" without a quantization_config take
    RANDOM_INT_CONFIGS's."""
    if quantization not in QUANTIZATIONS:
        raise ParamError("quantization", f"must be one of {QUANTIZATIONS}, got {quantization!r}")
    config = _resolve(quantization, hf_config, is_random_weights)
    if config is not None and config.method == "gguf" and hf_config.get("kv_lora_rank") is not None:
        raise ValueError("quantization='gguf': a multi-head latent attention model's (DeepSeek-V2's) GGUF linears "
                         "are not served as int blocks")
    return config


def _resolve(quantization: str | None, hf_config: dict, is_random_weights: bool) -> QuantConfig | None:
    if quantization == "gguf":
        return _gguf(hf_config)
    qc = hf_config.get("quantization_config")
    if quantization == "none":  # a .gguf dequantized at load even on a GPU; an unquantized checkpoint as it is
        if qc:
            raise ValueError(f"quantization='none': the checkpoint is quantized (quant_method "
                             f"{qc.get('quant_method')!r}) and is read as stored")
        return None
    if not qc:
        if quantization in ("awq", "gptq") and is_random_weights:
            return _int_checkpoint(quantization, quantization, _random_int_config(quantization, hf_config),
                                   hf_config)
        if quantization in ("awq", "gptq"):
            raise ValueError(f"quantization={quantization!r}: the checkpoint has no quantization_config (an "
                             f"{quantization.upper()} checkpoint is read as stored, never made at load; random "
                             "weights, load_format='random' or a preset, are drawn packed in a default layout)")
        return QuantConfig("fp8", is_checkpoint_fp8=False) if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "compressed-tensors" and _compressed_tensors_format(qc) == "pack-quantized":
        method = "pack-quantized"
    if quantization in ("awq", "gptq") or method in INT_METHODS:
        return _int_checkpoint(quantization, method, qc, hf_config)
    if method in ("fp8", "compressed-tensors"):
        config = _hf_fp8(qc) if method == "fp8" else _compressed_tensors(qc)
        if has_experts(hf_config):
            _check_moe_ignored(config, hf_config, method)
            return config
        kept = [p for p in config.ignored if "lm_head" not in p and "embed" not in p]
        if kept:  # Pagoda's FP8 layers are all of the decoder's linear layers, or none
            raise ValueError(f"quantization_config: {method} leaving decoder modules unquantized ({kept[:4]}) is "
                             "not supported")
        return config
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported (supported: 'fp8', "
                     f"'compressed-tensors' with format 'float-quantized' or 'pack-quantized', 'awq', 'gptq')")


def _compressed_tensors_format(qc: dict) -> str | None:
    """The checkpoint's format: top-level, or (newer compressed-tensors) that of its config groups."""
    if qc.get("format"):
        return qc["format"]
    formats = {group.get("format") for group in (qc.get("config_groups") or {}).values()}
    return formats.pop() if len(formats) == 1 else None


def _gguf(hf_config: dict) -> QuantConfig | None:
    """Int layers for a GGUF file's servable decoder linears (`gguf_linear_types`: ModelConfig.from_path reads them
    from the file), or None (dequantized at load) when it has none. The config is the first type's; the worker
    gives each linear its own (workers/weights.py `gguf_int_layers`)."""
    types = hf_config.get("gguf_linear_types")
    if types is None:
        raise ValueError("quantization='gguf' serves a .gguf model's own blocks; this model is not a GGUF file")
    served = [t for t in types if t in GGUF_INT_LAYOUTS]
    if len(served) != len(types):
        logger.warning("quantization='gguf': the decoder's linear weights are %s; those of %s (and fused q/k/v or "
                       "gate/up whose parts differ in type) are dequantized at load", "/".join(types) or "none",
                       "/".join(t for t in types if t not in served))
    return gguf_quant_config(served[0]) if served else None


def gguf_quant_config(qtype: str) -> QuantConfig:
    """The int layer of a GGUF block type (checkpoints/gguf_types.py: how it holds the blocks exactly)."""
    layout = GGUF_INT_LAYOUTS[qtype]
    return QuantConfig("gguf", False, weight="group", activation="none", bits=layout.bits,
                       group_size=layout.group_size, has_zero_points=False, has_mins=layout.has_mins,
                       scale_dtype=layout.scale_dtype)


def has_experts(hf_config: dict) -> bool:
    """Whether the model routes tokens to experts (Mixtral's num_local_experts, Qwen-MoE's num_experts,
    DeepSeek's n_routed_experts)."""
    return bool(hf_config.get("num_local_experts") or hf_config.get("num_experts")
                or hf_config.get("n_routed_experts"))


def _hf_fp8(qc: dict) -> QuantConfig:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config: quant_method 'fp8' activation_scheme {scheme!r} is not supported")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config: quant_method 'fp8' fmt {qc.get('fmt')!r} is not supported (e4m3)")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"quantization_config: weight_block_size must be [rows, cols], got {block!r}")
    if block is not None and scheme == "static":
        raise ValueError("quantization_config: quant_method 'fp8' with weight_block_size and a static "
                         "activation_scheme is not supported")
    ignored = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    return QuantConfig("fp8", True, "block" if block else "channel", tuple(block) if block else None, scheme,
                       "weight_scale_inv", ignored)


def _compressed_tensors(qc: dict) -> QuantConfig:
    fmt = _compressed_tensors_format(qc)
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} is not supported "
                         "(only 'float-quantized' FP8 and 'pack-quantized' int)")
    if qc.get("kv_cache_scheme"):
        raise ValueError("quantization_config: compressed-tensors kv_cache_scheme is not supported "
                         "(use kv_cache_dtype='fp8', whose scales Pagoda computes at load)")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"quantization_config: compressed-tensors with {len(groups)} config_groups is not "
                         "supported (one group of Linear targets)")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    _check_float8("weights", weights)
    if weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
        raise ValueError(f"quantization_config: compressed-tensors weights strategy {weights.get('strategy')!r} "
                         f"(dynamic={weights.get('dynamic')}) is not supported (static 'channel' or 'tensor')")
    if not inputs:
        raise ValueError("quantization_config: compressed-tensors weight-only FP8 (no input_activations) is not "
                         "supported")
    _check_float8("input_activations", inputs)
    if inputs.get("dynamic") and inputs.get("strategy") == "token":
        activation = "dynamic"
    elif not inputs.get("dynamic") and inputs.get("strategy") == "tensor":
        activation = "static"
    else:
        raise ValueError(f"quantization_config: compressed-tensors input_activations strategy "
                         f"{inputs.get('strategy')!r} with dynamic={inputs.get('dynamic')} is not supported "
                         "(dynamic 'token' or static 'tensor')")
    return QuantConfig("compressed-tensors", True, "channel", None, activation, "weight_scale",
                       tuple(qc.get("ignore") or ()))


def _check_float8(what: str, args: dict) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float" or args.get("symmetric") is False:
        raise ValueError(f"quantization_config: compressed-tensors {what} {args!r} is not supported "
                         "(8-bit symmetric float only)")


def _random_int_config(method: str, hf_config: dict) -> dict:
    """RANDOM_INT_CONFIGS[method], its group size halved (to 32 at least) until it divides every linear's input
    features the config names (DeepSeek-V2-Lite's dense intermediate size, 10,944, takes groups of 64)."""
    qc = dict(RANDOM_INT_CONFIGS[method])
    group: int = qc["group_size"]
    heads = hf_config.get("num_attention_heads") or 1
    head_dim = hf_config.get("v_head_dim") or hf_config.get("head_dim") or (hf_config.get("hidden_size") or 0) // heads
    shared = (hf_config.get("moe_intermediate_size") or 0) * (hf_config.get("n_shared_experts") or 0)
    named = [hf_config.get(k) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                        "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank")]
    sizes = [int(k) for k in named + [heads * head_dim, shared] if k]
    while group > min(INT_GROUP_SIZES) and any(k % group for k in sizes):
        group //= 2
    return {**qc, "group_size": group}


def _int_checkpoint(quantization: str | None, method: str | None, qc: dict, hf_config: dict) -> QuantConfig:
    """An AWQ, GPTQ or pack-quantized checkpoint's scheme; ValueError naming the first field Pagoda does not
    support."""
    if quantization is not None and quantization != method:
        raise ValueError(f"quantization={quantization!r} does not match the checkpoint's quantization_config "
                         f"quant_method {method!r}")
    assert method in INT_METHODS, f"not an int method: {method!r}"
    config = {"awq": _awq, "gptq": _gptq, "pack-quantized": _pack_quantized}[method](qc)
    if method == "pack-quantized":
        _check_whole_int32s(config, hf_config)
    if has_experts(hf_config):
        _check_moe_ignored(config, hf_config, method)
        return config
    kept = [p for p in config.ignored if "lm_head" not in p and "embed" not in p]
    if kept:
        raise ValueError(f"quantization_config: {method} modules_to_not_convert / ignore naming decoder modules "
                         f"({kept[:4]}) is not supported")
    return config


def _check_moe_ignored(config: QuantConfig, hf_config: dict, method: str) -> None:
    """A mixture-of-experts checkpoint may leave its routers, norms, LM head and whole shared experts unquantized
    (engine/moe_modules.py), nothing else."""
    found = first_ignored_module(config.ignored, hf_config, config.ignores_substrings)
    if found is not None:
        pattern, module = found
        how = " (AWQ skips every module whose name contains an entry)" if config.ignores_substrings else ""
        raise ValueError(f"quantization_config: {method} modules_to_not_convert / ignore entry {pattern!r} matches "
                         f"{module}{how}, which the tool then left unquantized and Pagoda holds quantized: not "
                         "supported")


def _int_group_size(method: str, qc: dict, allow_one_group: bool) -> int | None:
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if group_size == -1 and allow_one_group:
        return None
    if group_size not in INT_GROUP_SIZES:
        allowed = INT_GROUP_SIZES + ((-1,) if allow_one_group else ())
        raise ValueError(f"quantization_config: {method} group_size {group_size!r} is not supported {allowed}")
    return group_size


def _awq(qc: dict) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config: awq version {qc.get('version')!r} is not supported (only 'gemm', "
                         "AutoAWQ's GEMM packing; not gemv, gemv_fast, marlin, exllama or ipex)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config: awq bits {bits!r} is not supported (4)")
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"quantization_config: awq zero_point {qc.get('zero_point')!r} is not supported (true)")
    return QuantConfig("awq", False, weight="group", activation="none", bits=4,
                       group_size=_int_group_size("awq", qc, allow_one_group=False),
                       ignored=tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict) -> QuantConfig:
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config: gptq checkpoint_format {fmt!r} is not supported ('gptq', the v1 "
                         "packing AutoGPTQ and GPTQModel save, or 'gptq_v2')")
    if qc.get("is_marlin_format"):
        raise ValueError("quantization_config: gptq is_marlin_format true (AutoGPTQ's Marlin repacking) is not "
                         "supported")
    if qc.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"quantization_config: gptq pack_dtype {qc.get('pack_dtype')!r} is not supported "
                         "('int32')")
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"quantization_config: gptq bits {bits!r} is not supported (4 or 8)")
    for field in ("sym", "desc_act"):
        if not isinstance(qc.get(field, field == "sym"), bool):
            raise ValueError(f"quantization_config: gptq {field} {qc.get(field)!r} is not supported (true/false)")
    if qc.get("lm_head"):
        raise ValueError("quantization_config: gptq lm_head true (a quantized LM head) is not supported")
    if qc.get("dynamic"):
        raise ValueError("quantization_config: gptq dynamic (per-module overrides) is not supported")
    return QuantConfig("gptq", False, weight="group", activation="none", bits=bits,
                       group_size=_int_group_size("gptq", qc, allow_one_group=True),
                       desc_act=bool(qc.get("desc_act", False)),
                       ignored=tuple(qc.get("modules_to_not_convert") or ()), checkpoint_format=fmt)


def decoder_linear_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """Each decoder linear's weight [N, K] from config.json (the Llama family's names); {} when it lacks a field."""
    try:
        hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
        kv_heads = int(hf_config.get("num_key_value_heads") or heads)
        head_dim = int(hf_config.get("head_dim") or hidden // heads)
        inter = int(hf_config["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return {}
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter)}


def _check_whole_int32s(config: QuantConfig, hf_config: dict) -> None:
    """compressed-tensors packs each row of K values into ceil(K * bits / 32) int32s, padding the last one; the int
    layers read whole int32s of 32 / bits values: a K that does not fill them is a ValueError naming the tensor."""
    p = config.pack_factor
    for name, (n, k) in decoder_linear_shapes(hf_config).items():
        if k % p:
            raise ValueError(f"quantization_config: pack-quantized model.layers.*.{name}.weight_packed: its weight "
                             f"[{n}, {k}] has K = {k} input features, not a multiple of the {p} {config.bits}-bit "
                             "values an int32 holds (the checkpoint pads each row's last int32; not supported)")


ACT_ORDERS = {None: False, False: False, "weight": False, "static": False, True: True, "group": True, "dynamic": True}


def _pack_quantized(qc: dict) -> QuantConfig:
    """llm-compressor's weight-only int checkpoint (compressed-tensors' PackedQuantizationCompressor)."""
    if qc.get("kv_cache_scheme"):
        raise ValueError("quantization_config: compressed-tensors kv_cache_scheme is not supported")
    if qc.get("sparsity_config"):
        raise ValueError("quantization_config: compressed-tensors sparsity_config (sparse weights) is not supported")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"quantization_config: compressed-tensors with {len(groups)} config_groups is not "
                         "supported (one group of Linear targets)")
    group = groups[0]
    for field in ("input_activations", "output_activations"):
        if group.get(field):
            raise ValueError(f"quantization_config: pack-quantized {field} {group[field]!r} is not supported "
                             "(weight-only W4A16 / W8A16)")
    w = group.get("weights") or {}
    if w.get("type") != "int":
        raise ValueError(f"quantization_config: pack-quantized weights type {w.get('type')!r} is not supported "
                         "('int')")
    if w.get("num_bits") not in (4, 8):
        raise ValueError(f"quantization_config: pack-quantized weights num_bits {w.get('num_bits')!r} is not "
                         "supported (4 or 8)")
    if not isinstance(w.get("symmetric"), bool) or w.get("dynamic"):
        raise ValueError(f"quantization_config: pack-quantized weights symmetric {w.get('symmetric')!r} / dynamic "
                         f"{w.get('dynamic')!r} is not supported (symmetric true or false, static)")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"quantization_config: pack-quantized weights strategy {strategy!r} is not supported "
                         "('group' or 'channel')")
    actorder = w.get("actorder")
    if actorder not in ACT_ORDERS:
        raise ValueError(f"quantization_config: pack-quantized weights actorder {actorder!r} is not supported")
    group_size = _int_group_size("pack-quantized", w, allow_one_group=False) if strategy == "group" else None
    return QuantConfig("pack-quantized", False, weight="group", activation="none", bits=w["num_bits"],
                       group_size=group_size, desc_act=ACT_ORDERS[actorder] and group_size is not None,
                       ignored=tuple(qc.get("ignore") or ()), has_zero_points=not w["symmetric"],
                       scale_dtype="float32")  # bf16 or fp16 scales, kept exactly
