"""AWQ and GPTQ checkpoints served as stored (int4 packed in int32, dequantized per matmul, never held as floats).

The checkpoints are written by checkpoints/int4_rtn.py, which quantizes a tiny Llama round-to-nearest and packs
it as AutoAWQ (GEMM) and AutoGPTQ / GPTQModel (v1) pack (the libraries cannot be installed here). The oracle is
Pagoda on the same model with the dequantized weights written as a float32 checkpoint: the int layers dequantize
to exactly those floats and hand them to the same matmul, so tokens are equal and logprobs agree to 1e-4.
"""

import functools

import pytest
import torch

from checkpoints import int4_rtn as ic
from engine.quantization import resolve_quantization
from kernels.linear_int import AWQ_GEMM, gptq_v1, offset_binary, unpack_weight, unpack_zeros
from pagoda import LLM, SamplingParams
from tests.prompts import PARITY_PROMPTS

MAX_NEW = 8
# hidden 128, intermediate 256: every K a multiple of 128 (group 128), k/v 64 rows (whole int32s at tp 2)
SHAPE = {"hidden_size": 128, "intermediate_size": 256}
FORMATS = [ic.Int4Format("awq", 32), ic.Int4Format("awq", 128), ic.Int4Format("gptq", 32, sym=True),
           ic.Int4Format("gptq", 128, sym=False), ic.Int4Format("gptq", 32, sym=False, desc_act=True),
           ic.Int4Format("gptq", -1, sym=True), ic.Int4Format("gptq", 64, bits=8, sym=False, desc_act=True),
           ic.Int4Format("gptq", 32, desc_act=True, checkpoint_format="gptq_v2"),
           ic.Int4Format("gptq", 64, bits=8, sym=True, checkpoint_format="gptq_v2")]


def int4_factory(tmp_path_factory):
    """fmt -> (int4 checkpoint, its dequantized float32 checkpoint, each module's integers), written once."""
    from checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("int4")
    tiny_float = make_tiny_model(str(root / "float"), "llama", seed=3, config_overrides=SHAPE)

    @functools.lru_cache(maxsize=None)
    def checkpoint(fmt: ic.Int4Format) -> tuple[str, str, dict]:
        dst, oracle = str(root / fmt.name), str(root / f"{fmt.name}-oracle")
        return dst, oracle, ic.write_int4_checkpoint(tiny_float, dst, oracle, fmt)

    checkpoint.tiny_float = tiny_float  # type: ignore[attr-defined]
    return checkpoint


@pytest.fixture(scope="session")
def int4(tmp_path_factory):
    return int4_factory(tmp_path_factory)


def generate(model_dir: str, inspect=None, **kwargs):
    """Greedy outputs of the parity prompts; `inspect(llm)` runs before the engine shuts down."""
    kwargs.setdefault("num_kv_blocks", 256)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2)
    try:
        outs = llm.generate(PARITY_PROMPTS, params, use_tqdm=False)
        llm.engine.check_integrity()
        if inspect is not None:
            inspect(llm)
        return outs
    finally:
        llm.shutdown()


def assert_same(reference, outs):
    for ref, out in zip(reference, outs):
        ref_c, c = ref.outputs[0], out.outputs[0]
        assert c.token_ids == ref_c.token_ids, f"prompt {ref.prompt!r}"
        for ref_entry, entry in zip(ref_c.logprobs, c.logprobs):
            assert set(entry) == set(ref_entry)
            for token_id, logprob in ref_entry.items():
                assert abs(entry[token_id] - logprob) < 1e-4


def test_packing_as_the_tools_pack_it():
    """Literal int32s: AutoAWQ packs columns 0..7 in nibble order 0 2 4 6 1 3 5 7, AutoGPTQ rows 0..7 in order."""
    values = torch.arange(8, dtype=torch.int32)
    qz = ic.Quantized(values[None, :], values[None, :], torch.ones(1, 8, dtype=torch.float16),
                      torch.zeros(1, dtype=torch.int32))
    assert ic.pack_awq(qz)["qweight"].item() == 0x75316420
    column = ic.Quantized(values[:, None], torch.full((1, 1), 1, dtype=torch.int32), torch.ones(1, 1).half(),
                          torch.zeros(8, dtype=torch.int32))
    assert ic.pack_gptq(column, 4)["qweight"].item() == 0x76543210
    assert unpack_weight(torch.tensor([[0x75316420]], dtype=torch.int32), AWQ_GEMM).tolist() == [list(range(8))]
    assert unpack_weight(torch.tensor([[0x76543210]], dtype=torch.int32), gptq_v1(4)).flatten().tolist() \
        == list(range(8))
    zeros = ic.Quantized(values[:, None], values[None, :], torch.ones(1, 8).half(), torch.zeros(8, dtype=torch.int32))
    assert ic.pack_gptq(zeros, 4)["qzeros"].item() == 0x6543210F  # v1: zero - 1 (a zero of 0 wraps to 15)
    assert ic.pack_gptq(zeros, 4, v2=True)["qzeros"].item() == 0x76543210  # v2: as they are
    assert unpack_zeros(torch.tensor([[0x76543210]], dtype=torch.int32), offset_binary(4)).tolist() \
        == [list(range(8))]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_unpacking_gives_back_the_integers(int4, fmt):
    from safetensors.torch import load_file

    dst, _, layers = int4(fmt)
    tensors = load_file(f"{dst}/model.safetensors")
    packing = AWQ_GEMM if fmt.method == "awq" else offset_binary(fmt.bits) if fmt.is_gptq_v2 else gptq_v1(fmt.bits)
    for module, qz in layers.items():
        assert tensors[f"{module}.qweight"].dtype == torch.int32
        assert torch.equal(unpack_weight(tensors[f"{module}.qweight"], packing), qz.q)
        assert torch.equal(unpack_zeros(tensors[f"{module}.qzeros"], packing), qz.zeros)
        if fmt.method == "gptq":
            assert torch.equal(tensors[f"{module}.g_idx"], qz.g_idx)
    if fmt.desc_act:
        assert not torch.equal(qz.g_idx, torch.sort(qz.g_idx).values), "act-order's g_idx is shuffled"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_tokens_and_logprobs_equal_the_dequantized_model(int4, fmt):
    """Also what a layer holds after loading (workers/layers/quantization_int.py `finish_int_weights`): act-order
    layers' input features sorted by group (x's columns permuted a call), 4-bit GPTQ layers packed along N in AWQ's
    order with their zero points as stored (v1's offset kept), 8-bit ones along K as the checkpoint packs them."""
    dst, oracle, _ = int4(fmt)

    def inspect(llm):
        assert_holds_packed_weights(llm)
        for layer in _linears(llm):
            assert layer.packing.is_packed_along_k != (fmt.bits == 4), (fmt.name, layer.packing)
            assert layer.packing.zero_offset == (1 if fmt.method == "gptq" and not fmt.is_gptq_v2 else 0)
            # act-order sorted by group: x's columns permuted, no g_idx read
            assert (layer.input_perm is not None) == fmt.desc_act and not (fmt.desc_act and layer.g_idx is not None)
        if fmt.desc_act:  # read back as a matrix (MLA's kv_b_proj is): the checkpoint's column order
            from safetensors.torch import load_file

            from workers.layers.linear import dequantize_in_place

            qkv = _linears(llm)[0]
            dequantize_in_place(qkv, torch.float32)
            tensors = load_file(f"{oracle}/model.safetensors")
            assert torch.equal(qkv.weight, torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.weight"]
                                                      for p in "qkv"]))

    outs = generate(dst, inspect=inspect)
    assert_same(generate(oracle), outs)


def _linears(llm) -> list:
    layer = llm.engine.executor.worker.model.model.layers[0]
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def assert_holds_packed_weights(llm) -> None:
    layer = llm.engine.executor.worker.model.model.layers[0]
    assert layer.self_attn.qkv_proj.qweight.dtype == torch.int32 and layer.mlp.down_proj.weight is None
    floats = [name for name, p in layer.named_parameters() if p.is_floating_point() and name.endswith("weight")]
    assert all("norm" in name for name in floats), f"a float weight: {floats}"


def test_the_checkpoint_differs_from_the_float_model(int4):
    """The oracle is the quantized model, not the float one: the test above could fail."""
    _, oracle, _ = int4(FORMATS[0])
    float_outs, ref = generate(int4.tiny_float), generate(oracle)
    assert any(abs(a.outputs[0].logprobs[0][t] - b.outputs[0].logprobs[0][t]) > 1e-3
               for a, b in zip(ref, float_outs) for t in a.outputs[0].logprobs[0] if t in b.outputs[0].logprobs[0])


@pytest.mark.parametrize("change, field", [
    ({"version": "gemv"}, "version 'gemv'"), ({"version": "marlin"}, "version 'marlin'"),
    ({"version": "exllama"}, "version 'exllama'"), ({"zero_point": False}, "zero_point False"),
    ({"bits": 8}, "awq bits 8"), ({"group_size": 16}, "group_size 16"),
    ({"modules_to_not_convert": ["mlp.down_proj"]}, "modules_to_not_convert")])
def test_unsupported_awq_variants_are_refused(change, field):
    qc = {**ic.Int4Format("awq").quantization_config(), **change}
    with pytest.raises(ValueError, match=field):
        resolve_quantization(None, {"quantization_config": qc})


@pytest.mark.parametrize("change, field", [
    ({"bits": 3}, "gptq bits 3"), ({"bits": 2}, "gptq bits 2"), ({"pack_dtype": "int64"}, "pack_dtype 'int64'"),
    ({"is_marlin_format": True}, "is_marlin_format"), ({"checkpoint_format": "gptq_v3"}, "'gptq_v3'"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"), ({"group_size": 256}, "group_size 256"),
    ({"lm_head": True}, "lm_head"), ({"dynamic": {"-:.*down.*": {}}}, "dynamic"), ({"sym": None}, "sym None")])
def test_unsupported_gptq_variants_are_refused(change, field):
    qc = {**ic.Int4Format("gptq").quantization_config(), **change}
    with pytest.raises(ValueError, match=field):
        resolve_quantization(None, {"quantization_config": qc})


def test_refused_models_and_mismatches():
    awq = ic.Int4Format("awq").quantization_config()  # MoE models: tests/engine/test_moe_int4.py
    with pytest.raises(ValueError, match="does not match"):
        resolve_quantization("gptq", {"quantization_config": awq})
    with pytest.raises(ValueError, match="no quantization_config"):
        resolve_quantization("awq", {})
    config = resolve_quantization("awq", {"quantization_config": awq})
    assert (config.method, config.bits, config.group_size, config.is_packed_int) == ("awq", 4, 32, True)
    gptq = resolve_quantization(None, {"quantization_config": ic.Int4Format("gptq", -1, desc_act=True)
                                       .quantization_config()})
    assert (gptq.group_size, gptq.desc_act, gptq.pack_factor) == (None, True, 8)


def test_gptq_v2_read_from_quantize_config(int4, tmp_path):
    """GPTQ tools write quantize_config.json too: a v2 checkpoint whose config.json's quantization_config does not
    name its format, or which has none (AutoGPTQ's older saves), is read as that file says. Read as v1, every zero
    point would be off by one: the outputs would differ."""
    import json
    import os
    import shutil

    dst, oracle, _ = int4(ic.Int4Format("gptq", 32, desc_act=True, checkpoint_format="gptq_v2"))
    reference = generate(oracle)
    for name, keep in (("no-format", lambda qc: {k: v for k, v in qc.items() if k != "checkpoint_format"}),
                       ("no-config", None)):
        copy = shutil.copytree(dst, tmp_path / name)
        with open(copy / "config.json") as f:
            config = json.load(f)
        qc = config.pop("quantization_config")
        if keep is not None:
            config["quantization_config"] = keep(qc)
        with open(copy / "config.json", "w") as f:
            json.dump(config, f)
        assert_same(reference, generate(str(copy), inspect=_assert_v2))
    os.remove(tmp_path / "no-format" / "quantize_config.json")  # now nothing says v2: read as v1, it differs
    as_v1 = generate(str(tmp_path / "no-format"))
    assert any(abs(a.outputs[0].logprobs[0][t] - b.outputs[0].logprobs[0].get(t, 0.0)) > 1e-3
               for a, b in zip(reference, as_v1) for t in a.outputs[0].logprobs[0])


def _assert_v2(llm) -> None:
    layer = llm.engine.executor.worker.model.model.layers[0].mlp.down_proj
    # v2's zero points as stored (no v1 offset); held along N once sorted by group (finish_int_weights)
    assert layer.quant_config.checkpoint_format == "gptq_v2" and layer.packing.zero_offset == 0
    assert not layer.packing.is_packed_along_k and layer.input_perm is not None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_families(tmp_path, arch):
    """Qwen2's q/k/v biases (stored fp16, as the tools store them) and tied embeddings, Qwen3's head norms and
    head_dim 16, Mistral: AWQ and GPTQ act-order equal their dequantized checkpoints."""
    from checkpoints.tiny import make_tiny_model

    tiny = make_tiny_model(str(tmp_path / "float"), arch, seed=4, config_overrides=SHAPE)
    for fmt in (ic.Int4Format("awq", 32), ic.Int4Format("gptq", 64, desc_act=True)):
        dst, oracle = str(tmp_path / fmt.name), str(tmp_path / f"{fmt.name}-oracle")
        ic.write_int4_checkpoint(tiny, dst, oracle, fmt)
        assert_same(generate(oracle), generate(dst, inspect=assert_holds_packed_weights))


def assert_random_packed_weights(llm) -> None:
    """A random int layer (load_format="random"): dequantized, the initializer's standard deviation (0.3 for the tiny
    model) around a mean half a step below the zero point (uniform integers)."""
    from kernels.linear_int import dequantize_ref

    layer = llm.engine.executor.worker.model.model.layers[1].mlp.down_proj
    w = dequantize_ref(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, layer.group_size, layer.packing,
                       torch.float32)
    step = layer.scales.float().mean().item()
    assert abs(w.mean().item() + step / 2) < 0.01 and abs(w.std().item() - 0.3) < 0.02


@pytest.mark.parametrize("fmt", [ic.Int4Format("awq", 32), ic.Int4Format("gptq", 32, desc_act=True),
                                 ic.Int4Format("gptq", 64, bits=8)], ids=lambda f: f.name)
def test_random_weights_are_drawn_packed(int4, fmt):
    """load_format="random" on an int checkpoint's config: packed integers, zero points mid-range and scales that
    give the dequantized weight the initializer's standard deviation (0.3 for the tiny model); it generates."""
    dst, _, _ = int4(fmt)
    generate(dst, inspect=assert_random_packed_weights, load_format="random")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_random_weights_take_a_default_int4_layout(int4, method):
    """`--preset ... --quantization awq|gptq`: random weights and no quantization_config take RANDOM_INT_CONFIGS' layout
    (4 bits, group 128; AWQ's zero points, GPTQ symmetric in order), drawn packed; the model generates. A checkpoint's
    own weights without a quantization_config are still refused. A mixture-of-experts model's experts take the
    layout too (tests/checkpoints/test_presets.py builds the MoE presets so)."""
    from engine.config import ModelConfig

    config = resolve_quantization(method, {}, is_random_weights=True)
    assert (config.method, config.bits, config.group_size, config.desc_act) == (method, 4, 128, False)

    def inspect(llm):
        assert_random_packed_weights(llm)
        layer = llm.engine.executor.worker.model.model.layers[0].mlp.down_proj  # K = 256: two groups of 128
        assert layer.quant_config == config and tuple(layer.scales.shape) == (2, 128)
        assert torch.equal(unpack_zeros(layer.qzeros, layer.packing), torch.full((2, 128), 8, dtype=torch.int32))

    generate(int4.tiny_float, inspect=inspect, load_format="random", quantization=method)
    with pytest.raises(ValueError, match="no quantization_config"):
        ModelConfig.from_path(int4.tiny_float, quantization=method)
    assert resolve_quantization(method, {"num_local_experts": 8}, is_random_weights=True) == config


def test_g_idx_out_of_order_needs_desc_act(int4, tmp_path):
    """Without act-order the layers skip g_idx (k // group_size: a tile's zeros and scales are one row), so a
    checkpoint whose g_idx is shuffled but says desc_act false is refused at load, not served wrong."""
    import shutil

    dst, _, _ = int4(ic.Int4Format("gptq", 32, sym=False, desc_act=True))
    mislabelled = str(tmp_path / "mislabelled")
    shutil.copytree(dst, mislabelled)
    ic.set_quantization_config(mislabelled, ic.Int4Format("gptq", 32, sym=False).quantization_config())
    with pytest.raises(ValueError, match="desc_act false, but g_idx"):
        generate(mislabelled)


PHI3_SHAPE = {**SHAPE, "num_attention_heads": 8}  # head_dim 16, the tiny longrope factors' length


@pytest.mark.parametrize("fmt", [ic.Int4Format("awq", 32), ic.Int4Format("gptq", 32, desc_act=True),
                                 ic.Int4Format("gptq", 64, bits=8, sym=True, checkpoint_format="gptq_v2"),
                                 ic.Int4Format("pack-quantized", 32, sym=False, desc_act=True)],
                         ids=lambda f: f.name)
def test_phi3_fused_tensors_match_transformers(tmp_path_factory, fmt):
    """Phi-3 stores qkv_proj and gate_up_proj fused, and the tools pack each as one linear: the layer takes each
    part's N range of the packed tensors (AWQ's packed columns, GPTQ's columns, compressed-tensors' rows). Against
    transformers on the dequantized float32 checkpoint: prompt and output logprobs within 1e-4, greedy tokens."""
    from transformers import AutoModelForCausalLM

    from checkpoints.tiny import make_tiny_model
    from tests.hf_oracle import assert_matches_hf

    root = tmp_path_factory.mktemp("phi3-int")
    tiny = make_tiny_model(str(root / "float"), "phi3", seed=6, config_overrides=PHI3_SHAPE)
    dst, oracle = str(root / fmt.name), str(root / f"{fmt.name}-oracle")
    layers = ic.write_int4_checkpoint(tiny, dst, oracle, fmt)
    assert "model.layers.0.self_attn.qkv_proj" in layers and "model.layers.0.mlp.gate_up_proj" in layers
    llm = LLM(model=dst, dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    try:
        outs = llm.generate(PARITY_PROMPTS[:4], params, use_tqdm=False)
        assert_holds_packed_weights(llm)
    finally:
        llm.shutdown()
    hf_model = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    for out in outs:
        assert_matches_hf(hf_model, out, num_top=2, atol=1e-4)
