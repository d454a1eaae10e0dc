"""GGUF Q4_0 / Q4_1 / Q8_0 linears served from their own blocks (quantization="gguf"): each block of 32 weights is a
group of an int layer (Q4_1: with an additive minimum instead of a zero point), repacked exactly at load
(checkpoints/gguf.py GGUFIntSlice). The files are written with the gguf package's own quantizers
(tests/gguf_files.py); the oracle is Pagoda on the same file without quantization="gguf", which dequantizes it to
float32 at load: tokens equal, logprobs within 1e-4.
"""

import functools

import numpy as np
import pytest
import torch

from engine.quantization import resolve_quantization
from kernels.linear_int import dequantize_ref, offset_binary
from tests.engine.test_int4_checkpoints import SHAPE, assert_same, generate
from tests.gguf_files import write_gguf


def gguf_factory(tmp_path_factory):
    """(arch, qtype, tensor_types) -> a GGUF file of a tiny model (hidden 128, intermediate 256), written once."""
    from checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("gguf-int")

    @functools.lru_cache(maxsize=None)
    def tiny(arch: str) -> str:
        return make_tiny_model(str(root / arch), arch, seed=5, config_overrides=SHAPE)

    @functools.lru_cache(maxsize=None)
    def path(arch: str, qtype: str, tensor_types: tuple = ()) -> str:
        name = f"{arch}-{qtype}-{'-'.join(f'{k}.{v}' for k, v in tensor_types)}.gguf"
        return write_gguf(tiny(arch), str(root / name), qtype, tensor_types=dict(tensor_types))

    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    return gguf_factory(tmp_path_factory)


def assert_int_layers(bits: int, has_mins: bool = False):
    def check(llm):
        layer = llm.engine.executor.worker.model.model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert linear.weight is None and linear.qweight.dtype == torch.int32
            assert linear.packing == offset_binary(bits) and linear.group_size == 32
            assert (linear.mins is not None) == has_mins and (linear.qzeros is None) == has_mins
    return check


@pytest.mark.parametrize("arch, qtype", [("llama", "Q4_0"), ("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0"),
                                         ("qwen2", "Q4_1")])
def test_tokens_and_logprobs_equal_the_dequantized_file(ggufs, arch, qtype):
    """Llama's permuted q/k rows, Qwen2's biases and tied embeddings; the embeddings stay dequantized."""
    path = ggufs(arch, qtype)
    bits = 8 if qtype == "Q8_0" else 4
    assert_same(generate(path), generate(path, quantization="gguf", inspect=assert_int_layers(bits, qtype == "Q4_1")))


def test_the_builtin_smollm2_from_its_q4_1_blocks():
    """The built-in model's file (linears Q4_1, embeddings Q8_0) served from its blocks equals the same file
    dequantized at load (what the built-in model serves by default, converted to float32)."""
    from checkpoints.builtin import default_gguf_path

    path = default_gguf_path()
    assert_same(generate(path), generate(path, quantization="gguf", inspect=assert_int_layers(4, has_mins=True)))


def test_an_lm_head_of_another_type_leaves_the_linears_int(ggufs):
    """llama.cpp's Q4_0 files keep output.weight in more bits (Q6_K; Q8_0 here: gguf's Python quantizers write
    no k-quants): the LM head is dequantized, the linears are int."""
    path = ggufs("llama", "Q4_0", (("output.weight", "Q8_0"),))
    assert_same(generate(path), generate(path, quantization="gguf", inspect=assert_int_layers(4)))


def test_each_linear_as_its_type_allows(ggufs):
    """A file of mixed types: layer 0's attn_v in Q5_0 beside Q4_0 q/k (one fused matmul of two types: dequantized),
    its ffn_down in Q8_0 (8-bit int), layer 1's q/k/v all Q8_0 (8-bit int) and its attn_output Q4_1 (mins); the
    rest Q4_0."""
    path = ggufs("llama", "Q4_0", (("blk.0.attn_v.weight", "Q5_0"), ("blk.0.ffn_down.weight", "Q8_0"),
                                   ("blk.1.attn_q.weight", "Q8_0"), ("blk.1.attn_k.weight", "Q8_0"),
                                   ("blk.1.attn_v.weight", "Q8_0"), ("blk.1.attn_output.weight", "Q4_1")))

    def check(llm):
        layers = llm.engine.executor.worker.model.model.layers
        assert layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
        for linear, bits, has_mins in ((layers[0].self_attn.o_proj, 4, False), (layers[0].mlp.down_proj, 8, False),
                                       (layers[0].mlp.gate_up_proj, 4, False), (layers[1].self_attn.qkv_proj, 8, False),
                                       (layers[1].self_attn.o_proj, 4, True), (layers[1].mlp.down_proj, 4, False)):
            assert linear.weight is None and linear.packing == offset_binary(bits)
            assert (linear.mins is not None) == has_mins

    assert_same(generate(path), generate(path, quantization="gguf", inspect=check))


def test_no_servable_linear_loads_dequantized(ggufs):
    path = ggufs("llama", "Q5_0")

    def floats(llm):
        assert llm.engine.executor.worker.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32

    assert_same(generate(path), generate(path, quantization="gguf", inspect=floats))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_repacked_blocks_dequantize_as_gguf_does(ggufs, qtype):
    """Rows (in Hugging Face order) and column blocks of qweight / scales give gguf's own dequantization, bit for
    bit, for the whole tensor and for a rank's slice."""
    from checkpoints.gguf import iterate_gguf_weights, linear_module_types, open_gguf

    path = ggufs("llama", qtype)
    bits = 8 if qtype == "Q8_0" else 4
    p = 32 // bits
    weights = dict(iterate_gguf_weights(path, int_modules=set(linear_module_types(open_gguf(path)))))
    floats = dict(iterate_gguf_weights(path))
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        qweight, scales, w = weights[f"{module}.qweight"], weights[f"{module}.scales"], floats[f"{module}.weight"]
        n, k = w.get_shape()
        assert qweight.get_shape() == [n, k // p] and scales.get_shape() == [n, k // 32]
        for rows, cols in ((slice(None), slice(None)), (slice(16, 48), slice(32, 96))):
            q_cols = slice(cols.start // p, cols.stop // p) if cols.start is not None else cols
            s_cols = slice(cols.start // 32, cols.stop // 32) if cols.start is not None else cols
            qw, sc = qweight[rows, q_cols], scales[rows, s_cols]
            assert qw.dtype == torch.int32 and sc.dtype == torch.float16
            zeros = torch.full((sc.shape[1], sc.shape[0] // p), _mid_word(bits), dtype=torch.int32)
            mins = weights[f"{module}.mins"][rows, s_cols].t().contiguous() if qtype == "Q4_1" else None
            got = dequantize_ref(qw.t().contiguous(), None if qtype == "Q4_1" else zeros, sc.t().contiguous(), None,
                                 32, offset_binary(bits), torch.float32, mins)
            assert torch.equal(got, w[rows, cols])


def _mid_word(bits: int) -> int:
    word = sum((1 << (bits - 1)) << (bits * i) for i in range(32 // bits))
    return word - (1 << 32) if word >= 1 << 31 else word


def test_refusals_and_fallbacks():
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_quantization("gguf", {"architectures": ["LlamaForCausalLM"]})
    assert resolve_quantization("gguf", {"gguf_linear_types": ["Q5_0", "Q6_K"]}) is None  # dequantized at load
    assert resolve_quantization("gguf", {"gguf_linear_types": ["Q4_0", "Q5_0", "Q8_0"]}).method == "gguf"
    assert resolve_quantization("gguf", {"gguf_linear_types": ["Q4_1"]}).has_mins
    config = resolve_quantization("gguf", {"gguf_linear_types": ["Q8_0"]})
    assert (config.method, config.bits, config.group_size, config.has_zero_points) == ("gguf", 8, 32, False)
    assert np.int32(_mid_word(4)) == np.int32(-2004318072)  # 0x88888888


def test_random_weights_with_mins(ggufs):
    """load_format="random" with Q4_1's layers: mins centre the integers as a mid-range zero point would; the
    standard deviation is the initializer's (0.02: a GGUF's metadata names none, ModelArgs' default)."""
    path = ggufs("llama", "Q4_1")

    def check(llm):
        layer = llm.engine.executor.worker.model.model.layers[1].mlp.down_proj
        w = dequantize_ref(layer.qweight, None, layer.scales, None, 32, layer.packing, torch.float32, layer.mins)
        step = layer.scales.float().mean().item()
        assert layer.mins is not None and abs(w.mean().item() + step / 2) < 1e-3 and abs(w.std().item() - 0.02) < 2e-3

    generate(path, inspect=check, load_format="random", quantization="gguf")
