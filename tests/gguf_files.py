"""Writes GGUF files from tiny Hugging Face checkpoints, as llama.cpp's converter does: gguf's own tensor-name map,
q/k rows permuted for Llama, tensors quantized with gguf's quantizers, the tokenizer and chat template in the
metadata. Tests load them with Pagoda and with transformers' GGUF loader (the oracle)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
from safetensors.numpy import load_file

from tests import gguf_kquants as kquants

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe"}
# A checkpoint's expert weight (layer, expert, projection), and each projection's stacked tensor in a GGUF file
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_STACK = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
                 "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}
# llama.cpp's quantize keeps the routers unquantized (F32 here)
_KEPT_FLOAT = ("ffn_gate_inp",)


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from rotate-half to interleaved order."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The tiny Qwen2-MoE's shared expert (48 wide) is no whole number of 32-weight blocks: 64 in its files
WHOLE_BLOCKS = {"qwen2_moe": {"shared_expert_intermediate_size": 64}}


def tiny_gguf(tmp_path, arch: str, qtype: str) -> tuple[str, str, str]:
    """(a tiny checkpoint of `arch`, its GGUF file in `qtype`, the file's weights dequantized as a checkpoint)."""
    from checkpoints.tiny import make_tiny_model

    hf_dir = make_tiny_model(str(tmp_path / f"{arch}-hf"), arch, seed=3, config_overrides=WHOLE_BLOCKS.get(arch))
    path = write_gguf(hf_dir, str(tmp_path / f"{arch}.{qtype}.gguf"), qtype,
                      dequantized_dir=str(tmp_path / f"{arch}-dequantized"))
    return hf_dir, path, str(tmp_path / f"{arch}-dequantized")


def write_gguf(hf_dir: str, path: str, qtype: str = "Q8_0", sampling: dict | None = None,
               tensor_types: dict[str, str] | None = None, dequantized_dir: str | None = None) -> str:
    """A GGUF file of the checkpoint in hf_dir: 2-D weights in `qtype` (`tensor_types`: GGUF tensor name -> its
    own type, as llama.cpp's mixes give some tensors more bits), norms, biases and routers in F32; an MoE block's
    experts stacked [experts, rows, columns] a projection (`ffn_gate_exps`, ...) in `qtype`, Mixtral as `llama`
    with an expert count, as llama.cpp's converter writes them. The k-quants (Q4_K, Q5_K, Q6_K; rows of whole
    256-weight super-blocks) come from tests/gguf_kquants.py, the rest from gguf's quantizers.

    `dequantized_dir`: also a copy of the checkpoint there whose weights are what the file holds, dequantized by
    gguf (quantization works row by row, so it commutes with llama.cpp's q/k row permutation and with stacking):
    transformers' oracle for files its own GGUF loader does not read (its MoE configs miss the experts' width)."""
    import gguf

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = ARCH[cfg["architectures"][0]]
    num_layers, num_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta",
                                                                                                 10000.0))))
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    _add_experts(writer, cfg)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    _add_tokenizer(writer, hf_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)  # Qwen3-MoE's mlp_only_layers
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    stacks: dict[str, dict[int, tuple[str, np.ndarray]]] = {}  # GGUF stack -> expert -> (checkpoint name, weight)
    dequantized: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if (m := _EXPERT.fullmatch(name)) is not None:
            stacks.setdefault(f"blk.{m[1]}.{_EXPERT_STACK[m[3]]}.weight", {})[int(m[2])] = (name, w)
            continue
        stem, suffix = name.rsplit(".", 1)
        if arch == "llama" and ".q_proj" in name:
            w = _llama_cpp_permute(w, num_heads)
        elif arch == "llama" and ".k_proj" in name:
            w = _llama_cpp_permute(w, cfg["num_key_value_heads"])
        gguf_name = f"{names.get_name(stem) or dense_names.get_name(stem)}.{suffix}"
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp reads it as one vector [hidden]
        if w.ndim == 2 and gguf_name.split(".")[-2] not in _KEPT_FLOAT:
            dequantized[name] = _add_quantized(writer, gguf_name, w, (tensor_types or {}).get(gguf_name, qtype))
        else:
            writer.add_tensor(gguf_name, w.astype(np.float32))
            dequantized[name] = w.astype(np.float32).reshape(weights[name].shape)
    for gguf_name, experts in stacks.items():
        stack = np.stack([experts[e][1] for e in range(len(experts))])
        values = _add_quantized(writer, gguf_name, stack, (tensor_types or {}).get(gguf_name, qtype))
        for e, (name, _) in experts.items():  # each expert's dequantized weight under its checkpoint name
            dequantized[name] = values[e]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if dequantized_dir is not None:
        _write_dequantized(hf_dir, dequantized_dir, dequantized, num_heads, cfg["num_key_value_heads"], arch)
    return path


def _add_quantized(writer, gguf_name: str, w: np.ndarray, qtype: str) -> np.ndarray:
    """Adds `w` quantized to `qtype` (row by row along its last axis); returns gguf's dequantization of it."""
    import gguf

    own = gguf.GGMLQuantizationType[qtype]
    if own.name in kquants.QUANTIZERS:  # gguf has no quantizer for these
        data = kquants.quantize(w.astype(np.float32), own.name)
    else:
        data = gguf.quants.quantize(w.astype(np.float32), own)
    writer.add_tensor(gguf_name, data, raw_dtype=own)
    return gguf.quants.dequantize(data, own).reshape(w.shape)


def _add_experts(writer, cfg: dict) -> None:
    """The experts' metadata, as llama.cpp's converter writes it for Mixtral, Qwen2-MoE and Qwen3-MoE."""
    count = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not count:
        return
    writer.add_expert_count(count)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _write_dequantized(hf_dir: str, out_dir: str, dequantized: dict[str, np.ndarray], num_heads: int,
                       num_kv_heads: int, arch: str) -> None:
    """hf_dir's files, its weights replaced by the file's dequantized ones (q/k rows back in checkpoint order)."""
    import shutil

    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(hf_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    tensors = {}
    for name, w in dequantized.items():
        if arch == "llama" and (".q_proj" in name or ".k_proj" in name):
            heads = num_heads if ".q_proj" in name else num_kv_heads
            w = _llama_cpp_unpermute(w, heads)
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _llama_cpp_unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of `_llama_cpp_permute`."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer, hf_dir: str) -> None:
    """The byte-level BPE of tokenizer.json as llama.cpp's 'gpt2' tokenizer model, and the chat template."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control token
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    writer.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    writer.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    writer.add_add_bos_token(True)
    writer.add_chat_template(tok_cfg["chat_template"])
