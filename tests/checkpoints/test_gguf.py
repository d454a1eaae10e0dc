"""GGUF loading against transformers' own GGUF loader, on tiny checkpoints written the way llama.cpp writes them:
same logits (prompt and output logprobs), same tokenizer and chat template from the metadata; lazy slices that
dequantize only what a rank asks for; unsupported types and architectures named in the error."""

import json
import os

import numpy as np
import pytest
import torch

from checkpoints.gguf import GGUFSlice, gguf_hf_config, open_gguf, qk_row_order, read_gguf_model
from pagoda import LLM, SamplingParams
from tests.gguf_files import tiny_gguf, write_gguf
from tests.hf_oracle import assert_matches_hf
from tests.prompts import PARITY_PROMPTS


@pytest.fixture(scope="module")
def tiny_ggufs(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {arch: write_gguf(tiny_checkpoints[arch], str(root / f"tiny-{arch}.Q8_0.gguf"))
            for arch in ("llama", "qwen2")}


def hf_from_gguf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama: q/k rows permuted; qwen2: qkv biases, tied head
def test_tiny_gguf_matches_transformers_gguf_loader(tiny_ggufs, tiny_checkpoints, tiny_tokenizer, arch):
    hf_model, hf_tokenizer = hf_from_gguf(tiny_ggufs[arch])
    llm = LLM(model=tiny_ggufs[arch], dtype="float32", device="cpu", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=7)  # chunked prefill
    tokenizer = llm.get_tokenizer()
    assert tokenizer.chat_template == tiny_tokenizer.chat_template  # from the metadata
    for prompt in PARITY_PROMPTS:
        assert tokenizer.encode(prompt) == hf_tokenizer.encode(prompt)
        if arch == "llama":  # (transformers gives a qwen2 GGUF Qwen2's pre-tokenizer: digits one by one)
            assert tokenizer.encode(prompt) == tiny_tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, logprobs=2)
    for out in llm.generate(PARITY_PROMPTS, params, use_tqdm=False):
        assert_matches_hf(hf_model, out, num_top=2, atol=1e-4)
    config = llm.engine.config.model.hf_config
    with open(os.path.join(tiny_checkpoints[arch], "config.json")) as f:
        original = json.load(f)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "bos_token_id"):
        assert config[key] == original[key], key
    llm.shutdown()


MOE_CONFIG_KEYS = ("num_experts_per_tok", "moe_intermediate_size",
                   "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "intermediate_size")


@pytest.mark.parametrize("arch, qtype", [("mixtral", "Q4_1"), ("qwen2_moe", "Q8_0"), ("qwen3_moe", "Q4_0"),
                                         ("qwen3", "Q8_0")])
def test_gguf_equals_transformers_on_its_dequantized_weights(tmp_path, arch, qtype):
    """Mixture-of-experts files as llama.cpp's converter writes them: each block's experts stacked a projection
    (`ffn_gate_exps` [experts, rows, columns]); Mixtral as `llama` with an expert count (q/k rows permuted);
    Qwen2-MoE with its shared expert and gate (`ffn_*_shexp`, `ffn_gate_inp_shexp` a vector); Qwen3-MoE with its
    q/k norms and a dense first layer (mlp_only_layers); and dense Qwen3 (its head_dim from the file). Pagoda
    reads each expert's slice; its tokens and logprobs equal transformers' on the file's weights dequantized by
    gguf (transformers' own GGUF loader misses the experts' width and Qwen3's head_dim), with chunked prefill."""
    from transformers import AutoModelForCausalLM

    hf_dir, path, dequantized = tiny_gguf(tmp_path, arch, qtype)
    oracle = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, logprobs=2)
    for out in llm.generate(PARITY_PROMPTS, params, use_tqdm=False):
        assert_matches_hf(oracle, out, num_top=2, atol=1e-4)
    config = llm.engine.config.model.hf_config
    with open(os.path.join(hf_dir, "config.json")) as f:
        original = json.load(f)
    assert config["architectures"] == original["architectures"]
    experts = lambda c: c.get("num_local_experts") or c.get("num_experts")  # noqa: E731 (transformers writes both)
    assert experts(config) == experts(original)
    for key in MOE_CONFIG_KEYS:
        assert config.get(key) == original.get(key), key
    llm.shutdown()
    # converted to a checkpoint (checkpoints/builtin.py convert_gguf): the checkpoint's own names, shapes and the
    # file's values, bit for bit
    from safetensors.torch import load_file

    from checkpoints.builtin import convert_gguf

    converted = load_file(os.path.join(convert_gguf(path, str(tmp_path / "converted")), "model.safetensors"))
    expected = load_file(os.path.join(dequantized, "model.safetensors"))
    assert set(converted) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name


def test_sampling_metadata_becomes_the_generation_defaults(tiny_checkpoints, tmp_path):
    path = write_gguf(tiny_checkpoints["llama"], str(tmp_path / "s.gguf"), sampling={"temp": 0.25, "top_k": 7})
    info = read_gguf_model(path)
    assert info.generation_config["temperature"] == pytest.approx(0.25) and info.generation_config["top_k"] == 7
    assert len(info.header_digest) == 64


@pytest.fixture(scope="module")
def typed_tensors(tmp_path_factory):
    """One [6, 512] tensor per type: quantized by gguf where it can, random blocks for the K-quants."""
    import gguf

    path = str(tmp_path_factory.mktemp("types") / "types.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    values = rng.standard_normal((6, 512)).astype(np.float32)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16", "F32"):
        qtype = gguf.GGMLQuantizationType[name]
        data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS"):
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor(name, rng.integers(0, 256, (6, 512 // block * size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in open_gguf(path).tensors}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random K-quant blocks hold NaN and inf scales
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16", "F32", "Q2_K", "Q3_K",
                                  "Q4_K", "Q5_K", "Q6_K"])
def test_slices_dequantize_only_the_blocks_asked_for(typed_tensors, name, monkeypatch):
    from gguf.quants import dequantize

    tensor = typed_tensors[name]
    full = dequantize(tensor.data, tensor.tensor_type)  # [6, 512]
    sliced = GGUFSlice(tensor)
    assert sliced.get_shape() == [6, 512]
    seen = []
    real = GGUFSlice._dequantize
    monkeypatch.setattr(GGUFSlice, "_dequantize", lambda self, raw: seen.append(real(self, raw).size) or
                        real(self, raw))
    block = sliced.block_size
    np.testing.assert_array_equal(sliced[2:5].numpy(), full[2:5])
    np.testing.assert_array_equal(sliced[:, 256:512].numpy(), full[:, 256:512])  # a column shard on blocks
    np.testing.assert_array_equal(sliced[1:3, 3:100].numpy(), full[1:3, 3:100])  # inside blocks: rows, then cut
    assert seen[:2] == [3 * 512, 6 * 256]
    assert seen[2] == (2 * 97 if block == 1 else 2 * 512)
    order = qk_row_order(6, 2)  # a permuted tensor reads the rows of the map
    np.testing.assert_array_equal(GGUFSlice(tensor, order)[1:4].numpy(), full[order[1:4]])


def test_row_order_undoes_llama_cpp_permutation():
    from tests.gguf_files import _llama_cpp_permute

    hf = np.arange(3 * 8 * 2).reshape(3 * 8, 2)  # 3 heads of dim 8
    stored = _llama_cpp_permute(hf, 3)
    np.testing.assert_array_equal(stored[qk_row_order(24, 8)], hf)


def test_unsupported_types_and_architectures_are_named(typed_tensors, tmp_path):
    import gguf

    with pytest.raises(NotImplementedError, match="type IQ2_XXS, which Pagoda cannot dequantize"):
        GGUFSlice(typed_tensors["IQ2_XXS"])
    path = str(tmp_path / "phi.gguf")
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match="GGUF architecture 'phi3' is not supported"):
        gguf_hf_config(open_gguf(path))
