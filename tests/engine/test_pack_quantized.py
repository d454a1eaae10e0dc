"""compressed-tensors `format: "pack-quantized"` checkpoints (llm-compressor's W4A16 / W8A16) served as stored.

checkpoints/int4_rtn.py writes them as compressed-tensors' PackedQuantizationCompressor does (llm-compressor is
not installed here): weight_packed [N, K / p] holding the signed integers plus 2^(bits-1), packed along K;
weight_scale [N, G] in bf16; weight_zero_point [N / p, G] when asymmetric; weight_g_idx under actorder "group".
Pagoda holds the int32 words transposed into the int layer's K-packed layout (kernels.linear_int.offset_binary)
and must equal Pagoda on the dequantized float32 checkpoint: tokens equal, logprobs within 1e-4.
"""

import pytest
import torch

from checkpoints import int4_rtn as ic
from engine.quantization import resolve_quantization
from kernels.linear_int import offset_binary, unpack_weight, unpack_zeros
from tests.engine.test_int4_checkpoints import (
    assert_holds_packed_weights,
    assert_random_packed_weights,
    assert_same,
    generate,
    int4_factory,
)

FORMATS = [ic.Int4Format("pack-quantized", 32, sym=True), ic.Int4Format("pack-quantized", -1, sym=True),
           ic.Int4Format("pack-quantized", 128, sym=False),
           ic.Int4Format("pack-quantized", 32, sym=True, desc_act=True),
           ic.Int4Format("pack-quantized", 64, bits=8, sym=True)]


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    return int4_factory(tmp_path_factory)


def test_packing_as_compressed_tensors_packs_it():
    """pack_to_int32's own example: 8-bit signed [1, 2] are stored 129, 130 -> 33409 (fields 2 and 3 padding
    zeros, here the signed -128); 4-bit input features 0..7 of a row in fields 0..7."""
    q = torch.tensor([[129], [130], [0], [0]], dtype=torch.int32)  # [K, N] unsigned = signed + 128
    qz = ic.Quantized(q, torch.full((1, 1), 128, dtype=torch.int32), torch.ones(1, 1).bfloat16(),
                      torch.zeros(4, dtype=torch.int32))
    assert ic.pack_compressed_tensors(qz, 8, sym=True, has_g_idx=False)["weight_packed"].tolist() == [[33409]]
    row = ic.Quantized(torch.arange(8, dtype=torch.int32)[:, None], torch.full((1, 1), 8, dtype=torch.int32),
                       torch.ones(1, 1).bfloat16(), torch.zeros(8, dtype=torch.int32))
    packed = ic.pack_compressed_tensors(row, 4, sym=True, has_g_idx=False)["weight_packed"]
    assert packed.tolist() == [[0x76543210]]
    assert unpack_weight(packed.t(), offset_binary(4)).flatten().tolist() == list(range(8))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_unpacking_gives_back_the_integers(ct, fmt):
    from safetensors.torch import load_file

    dst, _, layers = ct(fmt)
    tensors = load_file(f"{dst}/model.safetensors")
    packing = offset_binary(fmt.bits)
    for module, qz in layers.items():
        assert tensors[f"{module}.weight_packed"].dtype == torch.int32
        assert tensors[f"{module}.weight_scale"].dtype == torch.bfloat16
        assert tensors[f"{module}.weight_shape"].tolist() == list(qz.q.t().shape)
        assert torch.equal(unpack_weight(tensors[f"{module}.weight_packed"].t(), packing), qz.q)
        if not fmt.sym:
            assert torch.equal(unpack_zeros(tensors[f"{module}.weight_zero_point"].t(), packing), qz.zeros)
        assert (f"{module}.weight_zero_point" in tensors) == (not fmt.sym)
        assert (f"{module}.weight_g_idx" in tensors) == fmt.desc_act


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_tokens_and_logprobs_equal_the_dequantized_model(ct, fmt):
    dst, oracle, _ = ct(fmt)

    def check(llm):
        assert_holds_packed_weights(llm)
        layer = llm.engine.executor.worker.model.model.layers[0].mlp.down_proj
        assert layer.scales.dtype == torch.float32 and ("qzeros" in dict(layer.named_buffers())) == fmt.sym

    assert_same(generate(oracle), generate(dst, inspect=check))


def test_qwen2_biases(tmp_path):
    """Qwen2's q/k/v biases (kept in the model's dtype by llm-compressor) and tied embeddings."""
    from checkpoints.tiny import make_tiny_model
    from tests.engine.test_int4_checkpoints import SHAPE

    tiny = make_tiny_model(str(tmp_path / "float"), "qwen2", seed=4, config_overrides=SHAPE)
    fmt = ic.Int4Format("pack-quantized", 32, sym=False, desc_act=True)
    dst, oracle = str(tmp_path / fmt.name), str(tmp_path / f"{fmt.name}-oracle")
    ic.write_int4_checkpoint(tiny, dst, oracle, fmt)
    assert_same(generate(oracle), generate(dst, inspect=assert_holds_packed_weights))


def _weights(**change) -> dict:
    qc = ic.Int4Format("pack-quantized", 128, sym=True).quantization_config()
    group = qc["config_groups"]["group_0"]
    return {**qc, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **change}}}}


@pytest.mark.parametrize("qc, field", [
    (_weights(num_bits=2), "num_bits 2"), (_weights(num_bits=3), "num_bits 3"),
    (_weights(type="float"), "type 'float'"), (_weights(strategy="tensor"), "strategy 'tensor'"),
    (_weights(strategy="block"), "strategy 'block'"), (_weights(group_size=16), "group_size 16"),
    (_weights(dynamic=True), "dynamic True"), (_weights(actorder="sometimes"), "actorder 'sometimes'"),
    ({**_weights(), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
    ({**_weights(), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({**_weights(), "ignore": ["lm_head", "re:.*down_proj"]}, "ignore"),
    ({**_weights(), "format": "int-quantized"}, "format 'int-quantized'"),
    ({**_weights(), "format": "marlin-24"}, "format 'marlin-24'"),
])
def test_unsupported_variants_are_refused(qc, field):
    with pytest.raises(ValueError, match=field):
        resolve_quantization(None, {"quantization_config": qc})


def test_w4a8_and_mismatches_are_refused():
    qc = _weights()
    group = qc["config_groups"]["group_0"]
    w4a8 = {**qc, "config_groups": {"group_0": {**group, "input_activations": {"num_bits": 8, "type": "int"}}}}
    with pytest.raises(ValueError, match="input_activations"):
        resolve_quantization(None, {"quantization_config": w4a8})
    with pytest.raises(ValueError, match="does not match"):
        resolve_quantization("awq", {"quantization_config": qc})
    config = resolve_quantization(None, {"quantization_config": qc})
    assert (config.method, config.bits, config.group_size, config.has_zero_points) == ("pack-quantized", 4, 128,
                                                                                       False)
    no_top_format = {k: v for k, v in qc.items() if k != "format"}  # newer versions: the format per group
    assert resolve_quantization(None, {"quantization_config": no_top_format}) == config


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2], FORMATS[4]], ids=lambda f: f.name)
def test_random_weights_are_drawn_packed(ct, fmt):
    """load_format="random" on a pack-quantized config: packed integers, zero points mid-range (stored or the
    symmetric buffer), scales giving the dequantized weight the initializer's standard deviation (0.3)."""
    dst, _, _ = ct(fmt)
    generate(dst, inspect=assert_random_packed_weights, load_format="random")


def test_a_k_that_does_not_fill_int32s_is_refused(tmp_path):
    """intermediate_size 252: down_proj's rows are 31.5 int32s of 4-bit values, which compressed-tensors pads to 32
    (checkpoints/int4_rtn.py pads as it does); refused when the engine reads the config, naming the tensor."""
    from checkpoints.tiny import make_tiny_model
    from pagoda import LLM

    qc = ic.Int4Format("pack-quantized", -1, sym=True).quantization_config()
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight_packed: its weight \[128, 252\]"):
        resolve_quantization(None, {"quantization_config": qc, "hidden_size": 128, "num_attention_heads": 4,
                                    "intermediate_size": 252})
    tiny = make_tiny_model(str(tmp_path / "float"), "llama", seed=3,
                           config_overrides={"hidden_size": 128, "intermediate_size": 252})
    fmt = ic.Int4Format("pack-quantized", -1, sym=True)
    ic.write_int4_checkpoint(tiny, str(tmp_path / "ct"), str(tmp_path / "oracle"), fmt)
    with pytest.raises(ValueError, match="K = 252 input features, not a multiple of the 8 4-bit values"):
        LLM(model=str(tmp_path / "ct"), dtype="float32", device="cpu", num_kv_blocks=16)
