"""Writes GGUF files from tiny Hugging Face checkpoints, as llama.cpp's converter does: gguf's own tensor-name map,
q/k rows permuted for Llama, tensors quantized with gguf's quantizers, the tokenizer and chat template in the
metadata. Tests load them with Pagoda and with transformers' GGUF loader (the oracle)."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file

from tests import gguf_kquants as kquants

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from rotate-half to interleaved order."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, path: str, qtype: str = "Q8_0", sampling: dict | None = None,
               tensor_types: dict[str, str] | None = None) -> str:
    """A GGUF file of the checkpoint in hf_dir: 2-D weights in `qtype` (`tensor_types`: GGUF tensor name -> its
    own type, as llama.cpp's mixes give some tensors more bits), norms and biases in F32. The k-quants (Q4_K,
    Q5_K, Q6_K; rows of whole 256-weight super-blocks) come from tests/gguf_kquants.py, the rest from gguf's
    quantizers."""
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
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    _add_tokenizer(writer, hf_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    for name, w in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        stem, suffix = name.rsplit(".", 1)
        if arch == "llama" and ".q_proj" in name:
            w = _llama_cpp_permute(w, num_heads)
        elif arch == "llama" and ".k_proj" in name:
            w = _llama_cpp_permute(w, cfg["num_key_value_heads"])
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        if w.ndim == 2:
            own = gguf.GGMLQuantizationType[(tensor_types or {}).get(gguf_name, qtype)]
            if own.name in kquants.QUANTIZERS:  # gguf has no quantizer for these
                data = kquants.quantize(w.astype(np.float32), own.name)
            else:
                data = gguf.quants.quantize(w.astype(np.float32), own)
            writer.add_tensor(gguf_name, data, raw_dtype=own)
        else:
            writer.add_tensor(gguf_name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
