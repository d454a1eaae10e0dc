"""GGUF checkpoints (llama.cpp's format): metadata -> a config.json dict, tensors -> lazily dequantized slices under
Hugging Face names, and a tokenizer built once from the metadata.

A GGUF tensor of shape [rows, cols] (Hugging Face order; GGUF lists it reversed) is stored row by row, each row a
run of quantization blocks of `block_size` elements along the columns:

    row r:  [block 0: scale(s) + block_size codes][block 1] ... [block cols/block_size - 1]

so `GGUFSlice[a:b]` dequantizes only rows a..b, and `GGUFSlice[:, a:b]` only the blocks that cover columns a..b
when a and b fall on block boundaries (otherwise the whole rows, then the columns are cut). Each tensor-parallel
rank thus dequantizes only its shard, as it reads only its slice of a safetensors file.

Mixture-of-experts files (Mixtral, written as `llama` with an expert count; `qwen2moe`; `qwen3moe`) stack each
block's experts in one tensor a projection (`ffn_gate_exps` [experts, rows, columns]); each expert is read as its
own slice, under the name a checkpoint gives it. The experts are dequantized (into the model's dtype, or FP8's),
unless quantization="gguf" serves them from their blocks (below) as it serves the other linears.

llama.cpp stores the q and k projections of Llama models with each head's rows interleaved for its rotary layout
(pairs (x0, x_{d/2}), (x1, x_{d/2+1}), ...); the slices undo that with a row permutation, read lazily like the rest.

With quantization="gguf", a decoder linear stored Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K is served from
its own blocks instead: `GGUFIntSlice` (checkpoints/gguf_blocks.py) repacks the rows and blocks a rank asks for
into an int layer's qweight / scales / mins, exactly (checkpoints/gguf_types.py: each type's layout); so is each
expert of a layer whose experts are served from their blocks (its gate and up of one such type, its down of one).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Container, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from checkpoints.gguf_blocks import GGUFIntSlice
from checkpoints.gguf_types import INT_LAYOUTS
from checkpoints.source import build_once, cache_root

# Types `gguf.quants.dequantize` handles and that Pagoda has checked; any other type is an error naming it.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp",
            "ffn_up_shexp", "ffn_down_shexp")
# general.architecture -> the model class; llama with {arch}.expert_count is Mixtral (llama.cpp converts it so)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # config.json's model_type, where it differs
_PERMUTED_QK = {"llama", "mixtral"}  # model types whose q/k rows llama.cpp's converter permutes (Llama's, Mixtral's)
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# An MoE block's experts, stacked [experts, rows, columns] per projection: each expert's own tensor in a checkpoint
_EXPERT_TENSORS = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                   "ffn_down_exps": ("down_proj", "w2")}
# general.sampling.* (llama.cpp's recommended sampling) -> generation_config.json names
_SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True)
class GGUFModelInfo:
    hf_config: dict  # config.json equivalent
    generation_config: dict  # generation_config.json equivalent
    header_digest: str  # sha256 of the metadata and tensor table (everything before the tensor data)
    linear_types: tuple[str, ...]  # the types of the decoder's linear weights (q/k/v/o, gate/up/down), sorted


def open_gguf(path: str):
    from gguf import GGUFReader

    return GGUFReader(path)


def read_gguf_model(path: str) -> GGUFModelInfo:
    reader = open_gguf(path)
    return GGUFModelInfo(gguf_hf_config(reader), gguf_generation_config(reader), header_digest(path, reader),
                         linear_types(reader))


def linear_types(reader) -> tuple[str, ...]:
    return tuple(sorted(set(linear_module_types(reader).values())))


def linear_module_types(reader) -> dict[str, str]:
    """Hugging Face module name of each decoder linear ("model.layers.0.self_attn.q_proj") -> its GGUF type."""
    return {hf_tensor_name(t.name)[: -len(".weight")]: t.tensor_type.name for t in reader.tensors
            if _is_linear_weight(t.name)}


def experts_module(layer: int, model_type: str) -> str:
    """A layer's experts as a checkpoint names them: Mixtral's "model.layers.0.block_sparse_moe.experts", Qwen-MoE's
    "model.layers.0.mlp.experts"."""
    return f"model.layers.{layer}.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}.experts"


def expert_types(reader) -> dict[int, dict[str, str]]:
    """Layer -> the GGUF type of its stacked experts tensors, by projection ("gate_proj", "up_proj", "down_proj")."""
    types: dict[int, dict[str, str]] = {}
    for t in reader.tensors:
        stem = t.name.rsplit(".", 1)[0].split(".")
        if len(stem) == 3 and stem[0] == "blk" and stem[2] in _EXPERT_TENSORS:
            types.setdefault(int(stem[1]), {})[_EXPERT_TENSORS[stem[2]][0]] = t.tensor_type.name
    return types


def _is_linear_weight(gguf_name: str) -> bool:
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEARS and parts[3] == "weight"


def header_digest(path: str, reader) -> str:
    """Identifies the metadata (tokenizer and chat template included) without hashing gigabytes of weights."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(reader.data_offset)).hexdigest()


def _fields(reader) -> dict:
    """Metadata as Python values, skipping the tokenizer's big arrays (transformers reads those)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}


def gguf_hf_config(reader) -> dict:
    """A config.json dict from the GGUF metadata. Raises NotImplementedError for what Pagoda cannot run."""
    meta = _fields(reader)
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise NotImplementedError("GGUF tensor rope_freqs.weight (llama3-style RoPE scaling) is not supported")
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    num_experts = int(get("expert_count", 0))
    if arch == "llama" and num_experts:
        arch_name, model_type = "MixtralForCausalLM", "mixtral"
    elif arch in ("qwen2moe", "qwen3moe") or not num_experts:
        arch_name, model_type = _ARCHITECTURES[arch], _MODEL_TYPES.get(arch, arch)
    else:
        raise NotImplementedError(f"GGUF architecture {arch!r} with {num_experts} experts is not supported")
    num_heads = int(get("attention.head_count"))
    num_kv_heads = get("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise NotImplementedError("GGUF attention.head_count_kv per layer is not supported")
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise NotImplementedError(f"partial rotary embeddings (rope.dimension_count "
                                  f"{get('rope.dimension_count')} of head_dim {head_dim}) are not supported")
    vocab_size = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": [arch_name], "model_type": model_type, "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads, "num_key_value_heads": int(num_kv_heads), "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu", "torch_dtype": "float32",
    }
    if arch.startswith("qwen"):
        config["use_sliding_window"] = False
    if num_experts:
        config.update(_moe_config(arch, model_type, get, names, config["num_hidden_layers"]))
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise NotImplementedError(f"GGUF rope.scaling.type {scaling!r} is not supported (supported: none, linear)")
    for key in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    return config


def _moe_config(arch: str, model_type: str, get, names: set[str], num_layers: int) -> dict:
    """The experts' fields of config.json: counts, widths, and (Qwen) the layers with a dense MLP instead. The top-k
    weights' normalization is what llama.cpp's graph for the architecture does (it stores no key for it): Mixtral
    and Qwen3-MoE normalize them, Qwen2-MoE does not."""
    count, used = int(get("expert_count")), int(get("expert_used_count"))
    if model_type == "mixtral":
        return {"num_local_experts": count, "num_experts_per_tok": used, "sliding_window": None}
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    config = {"num_experts": count, "num_experts_per_tok": used, "norm_topk_prob": arch == "qwen3moe",
              "moe_intermediate_size": int(get("expert_feed_forward_length")), "decoder_sparse_step": 1,
              "mlp_only_layers": dense}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return config


def gguf_generation_config(reader) -> dict:
    """generation_config.json's fields: special token ids and llama.cpp's recommended sampling, where present."""
    meta = _fields(reader)
    config = {key: value for key, value in gguf_hf_config(reader).items() if key.endswith("_token_id")}
    for key, name in _SAMPLING_KEYS.items():
        if f"general.sampling.{key}" in meta:
            config[name] = meta[f"general.sampling.{key}"]
    return config


# ---- tensors -----------------------------------------------------------------------------------------------------
def hf_tensor_name(gguf_name: str) -> str:
    """token_embd.weight -> model.embed_tokens.weight, blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight.
    Raises ValueError for a tensor Pagoda has no parameter for."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in Pagoda's models")


def iterate_gguf_weights(path: str, hf_config: dict | None = None,
                         int_modules: Container[str] = ()) -> Iterator[tuple[str, GGUFSlice | GGUFIntSlice]]:
    """(Hugging Face name, lazy slice) for every tensor of the file, as `weights.iterate_weights` yields them;
    a served linear of `int_modules` (Hugging Face module names) as its `qweight`, `scales` (and `mins`) blocks
    (`GGUFIntSlice`), not dequantized; so the experts of a layer whose `experts_module` is named there."""
    reader = open_gguf(path)
    hf_config = hf_config or gguf_hf_config(reader)
    head_dim = hf_config["head_dim"]
    permuted = hf_config["model_type"] in _PERMUTED_QK
    mixtral = hf_config["model_type"] == "mixtral"
    for tensor in reader.tensors:
        stem = tensor.name.rsplit(".", 1)[0].split(".")
        if len(stem) == 3 and stem[0] == "blk" and stem[2] in _EXPERT_TENSORS:
            module = experts_module(int(stem[1]), hf_config["model_type"])
            yield from _expert_slices(tensor, module, _EXPERT_TENSORS[stem[2]][mixtral], int_modules)
            continue
        name = hf_tensor_name(tensor.name)
        if mixtral:  # its router's name in a checkpoint (Qwen-MoE's: mlp.gate)
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        if name.endswith(".shared_expert_gate.weight") and len(tensor.shape) == 1:  # [hidden]: one output row
            yield name, GGUFSlice(tensor, as_row=True)
            continue
        rows = None
        if permuted and (".q_proj." in name or ".k_proj." in name):
            rows = qk_row_order(int(tensor.shape[-1]), head_dim)
        sliced = GGUFSlice(tensor, rows)
        module = name[: -len(".weight")]
        layout = INT_LAYOUTS.get(tensor.tensor_type.name)
        if module in int_modules and _is_linear_weight(tensor.name) and layout is not None:
            parts = ("qweight", "scales", "mins") if layout.has_mins else ("qweight", "scales")
            for part in parts:
                yield f"{module}.{part}", GGUFIntSlice(sliced, part)
        else:
            yield name, sliced


def _expert_slices(tensor, module: str, proj: str,
                   int_modules: Container[str]) -> Iterator[tuple[str, GGUFSlice | GGUFIntSlice]]:
    """A stacked experts tensor [experts, rows, columns] as each expert's own weight, under the checkpoint's name
    (`module`.{e}.w1 / w3 / w2 for Mixtral, .gate_proj / up_proj / down_proj for Qwen-MoE): a slice reads only that
    expert's rows. Experts served as int blocks (`module` in `int_modules`): each expert's `qweight`, `scales`
    (and `mins`)."""
    layout = INT_LAYOUTS.get(tensor.tensor_type.name) if module in int_modules else None
    for expert in range(int(tensor.shape[-1])):
        sliced = GGUFSlice(tensor, expert=expert)
        if layout is None:
            yield f"{module}.{expert}.{proj}.weight", sliced
            continue
        for part in ("qweight", "scales", "mins") if layout.has_mins else ("qweight", "scales"):
            yield f"{module}.{expert}.{proj}.{part}", GGUFIntSlice(sliced, part)


def qk_row_order(num_rows: int, head_dim: int) -> np.ndarray:
    """For each Hugging Face row of a q/k projection, the GGUF row that holds it: within a head, HF row
    half * d/2 + j is GGUF row 2j + half (llama.cpp's permute, undone)."""
    i = np.arange(num_rows)
    head, local = i // head_dim, i % head_dim
    half = head_dim // 2
    return head * head_dim + (local % half) * 2 + local // half


class GGUFSlice:
    """A GGUF tensor read like a safetensors slice: `get_shape()`, `[a:b]` (rows), `[:, a:b]` (columns), `[:]`.
    Indexing dequantizes what it returns to a float32 tensor."""

    def __init__(self, tensor, row_order: np.ndarray | None = None, expert: int | None = None, as_row: bool = False):
        """`expert`: of a stacked experts tensor [experts, rows, columns], that expert's [rows, columns]; `as_row`:
        a 1-D tensor read as one row [1, n]."""
        from gguf import GGML_QUANT_SIZES

        self.name = tensor.name if expert is None else f"{tensor.name}[{expert}]"
        self.qtype = tensor.tensor_type
        if self.qtype.name not in SUPPORTED_TYPES:
            raise NotImplementedError(f"GGUF tensor {tensor.name!r} has type {self.qtype.name}, which Pagoda cannot "
                                      f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
        self.shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        self.data = tensor.data  # memory-mapped: [rows, bytes per row], or elements for F32 / F16
        if expert is not None:  # [experts, rows, bytes per row] (or elements)
            self.shape, self.data = self.shape[1:], self.data[expert]
        if as_row:
            self.shape, self.data = (1, *self.shape), self.data.reshape(1, -1)
        self.block_size, self.type_size = GGML_QUANT_SIZES[self.qtype]
        self.row_order = row_order

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key) -> torch.Tensor:
        rows, cols = (key, slice(None)) if not isinstance(key, tuple) else (key + (slice(None),))[:2]
        if not (isinstance(rows, slice) and isinstance(cols, slice) and rows.step in (None, 1)
                and cols.step in (None, 1)):
            raise TypeError(f"GGUF tensor {self.name!r}: only [a:b] and [:, a:b] slices are supported, got {key!r}")
        raw = self._rows(rows)
        if len(self.shape) == 1:
            return _as_tensor(self._dequantize(raw))
        start, stop, _ = cols.indices(self.shape[1])
        if self.data.dtype != np.uint8:  # F32 / F16: elements
            out = self._dequantize(raw[:, start:stop])
        elif start % self.block_size == 0 and stop % self.block_size == 0:  # whole blocks: only those
            first, last = start // self.block_size * self.type_size, stop // self.block_size * self.type_size
            out = self._dequantize(raw[:, first:last])
        else:  # a column range inside quantization blocks: whole rows, then cut
            out = self._dequantize(raw)[:, start:stop]
        return _as_tensor(out)

    def _rows(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        if self.row_order is None:
            return self.data[start:stop]
        return self.data[self.row_order[start:stop]]  # fancy indexing on the memory map reads only these rows

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        from gguf.quants import dequantize

        return dequantize(raw, self.qtype)


def _as_tensor(values: np.ndarray) -> torch.Tensor:
    """float32, contiguous and writable (an F32 tensor's rows are a read-only view of the memory map: copied)."""
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


# ---- tokenizer ---------------------------------------------------------------------------------------------------
def gguf_tokenizer_dir(path: str, digest: str) -> str:
    """A tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template) built once from the GGUF
    metadata by transformers (slow: seconds) and cached under $PAGODA_CACHE/gguf-tokenizers/<digest>."""

    def build(tmp: str) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                  gguf_file=os.path.basename(path))
        tokenizer.save_pretrained(tmp)
        # Reloaded as a model-specific class (Qwen2Tokenizer, ...), transformers rebuilds parts of it (the
        # pre-tokenizer) from that class's defaults; the generic class takes tokenizer.json as it was built.
        config_path = os.path.join(tmp, "tokenizer_config.json")
        with open(config_path) as f:
            config = json.load(f)
        with open(config_path, "w") as f:
            json.dump({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2, sort_keys=True)

    return build_once(os.path.join(cache_root(), "gguf-tokenizers", digest[:24]), build,
                      marker="tokenizer_config.json")
