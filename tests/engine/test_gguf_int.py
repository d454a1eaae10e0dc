"""GGUF linears served from their own blocks (quantization="gguf"): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants
Q4_K, Q5_K, Q6_K, each group of 32 (Q6_K: 16) weights a group of an int layer, repacked exactly at load
(checkpoints/gguf_blocks.py, layouts in checkpoints/gguf_types.py). The files are written with the gguf package's
own quantizers (the k-quants, which it does not write, by tests/gguf_kquants.py in ggml's block layout); the oracle
is gguf's own dequantization: bit for bit for the repacked tensors, and Pagoda on the same file without
quantization="gguf" (dequantized to float32 at load) for whole models: tokens equal, logprobs within 1e-4.
"""

import functools

import numpy as np
import pytest
import torch

from checkpoints.gguf_types import INT_LAYOUTS
from engine.quantization import resolve_quantization
from kernels.linear_int import AWQ_FIELDS, IntPacking, dequantize_ref, offset_binary
from tests.engine.test_int4_checkpoints import SHAPE, assert_same, generate, int4_factory
from tests.gguf_files import write_gguf
from tests.gguf_kquants import QUANTIZERS as K_QUANTS

WIDE = {"hidden_size": 256, "intermediate_size": 512}  # k-quant rows are whole super-blocks of 256


def gguf_factory(tmp_path_factory):
    """(arch, qtype, tensor_types) -> a GGUF file of a tiny model (hidden 128, intermediate 256; 256 and 512 when a
    type is a k-quant), written once."""
    from checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("gguf-int")

    @functools.lru_cache(maxsize=None)
    def tiny(arch: str, wide: bool) -> str:
        return make_tiny_model(str(root / f"{arch}-{wide}"), arch, seed=5, config_overrides=WIDE if wide else SHAPE)

    @functools.lru_cache(maxsize=None)
    def path(arch: str, qtype: str, tensor_types: tuple = ()) -> str:
        name = f"{arch}-{qtype}-{'-'.join(f'{k}.{v}' for k, v in tensor_types)}.gguf"
        wide = any(t in K_QUANTS for t in (qtype, *(v for _, v in tensor_types)))
        return write_gguf(tiny(arch, wide), str(root / name), qtype, tensor_types=dict(tensor_types))

    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    return gguf_factory(tmp_path_factory)


def held_packing(layout) -> IntPacking:
    """The packing a layer of this GGUF type holds once loaded: 4-bit fields with zero points (Q4_0) along N in AWQ's
    order (workers/layers/quantization_int.py `finish_int_weights`), the rest along K as repacked from the file."""
    if layout.bits == 4 and not layout.has_mins:
        return IntPacking(bits=4, is_packed_along_k=False, fields=AWQ_FIELDS, zero_offset=0)
    return offset_binary(layout.bits)


def assert_layout(linear, qtype: str) -> None:
    """`linear` holds `qtype`'s blocks as checkpoints/gguf_types.py says."""
    layout = INT_LAYOUTS[qtype]
    assert linear.weight is None and linear.qweight.dtype == torch.int32, qtype
    assert linear.packing == held_packing(layout) and linear.group_size == layout.group_size, qtype
    assert (linear.mins is not None) == layout.has_mins and (linear.qzeros is None) == layout.has_mins, qtype
    assert linear.scales.dtype == getattr(torch, layout.scale_dtype), qtype


def assert_int_layers(qtype: str):
    def check(llm):
        layer = llm.engine.executor.worker.model.model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert_layout(linear, qtype)
    return check


@pytest.mark.parametrize("arch, qtype", [("llama", t) for t in INT_LAYOUTS] + [("qwen2", "Q4_0"), ("qwen2", "Q4_1"),
                                                                              ("qwen2", "Q5_K")])
def test_tokens_and_logprobs_equal_the_dequantized_file(ggufs, arch, qtype):
    """Every served type; Llama's permuted q/k rows, Qwen2's biases and tied embeddings; the embeddings stay
    dequantized."""
    path = ggufs(arch, qtype)
    assert_same(generate(path), generate(path, quantization="gguf", inspect=assert_int_layers(qtype)))


def assert_expert_layout(experts, w13_type: str | None, w2_type: str | None) -> None:
    """A FusedMoE holds its gate/up (w13) and down (w2) experts as these types' blocks; None, None: float."""
    if w13_type is None:
        assert experts.quant_config is None and experts.w13_weight.dtype == torch.float32
        return
    assert not hasattr(experts, "w13_weight") and not hasattr(experts, "w2_weight")
    for proj, qtype in (("w13", w13_type), ("w2", w2_type)):
        layout, held = INT_LAYOUTS[qtype], experts.projections[proj]
        assert getattr(experts, f"{proj}_qweight").dtype == torch.int32, (proj, qtype)
        assert held.packing == held_packing(layout) and held.config.group_size == layout.group_size, qtype
        assert (getattr(experts, f"{proj}_mins") is not None) == layout.has_mins, (proj, qtype)
        assert getattr(experts, f"{proj}_scales").dtype == getattr(torch, layout.scale_dtype), (proj, qtype)


# (arch, qtype, tensor types of the file, each layer's expected (w13, w2) types)
MOE_FILES = [
    ("qwen2_moe", "Q4_1", {}, [("Q4_1", "Q4_1")] * 2),
    # down in another type (llama.cpp's Q4_K_M keeps some in Q6_K); minimums in one projection only
    ("mixtral", "Q8_0", {"blk.0.ffn_down_exps.weight": "Q4_1", "blk.1.ffn_down_exps.weight": "Q4_1"},
     [("Q8_0", "Q4_1")] * 2),
    # gate and up of different types are one GEMM: that layer's experts dequantized, the other's int
    ("mixtral", "Q4_0", {"blk.1.ffn_gate_exps.weight": "Q8_0"}, [("Q4_0", "Q4_0"), (None, None)]),
]


@pytest.mark.parametrize("arch, qtype, tensor_types, expected", MOE_FILES)
def test_moe_files_serve_their_linears_and_experts_from_blocks(tmp_path, arch, qtype, tensor_types, expected):
    """An MoE file under quantization="gguf": attention, Qwen2-MoE's shared expert and the routed experts from
    their blocks (the fused MoE kernel's int tiles, GGUF's minimums added); the same tokens and logprobs as the
    file dequantized at load."""
    from checkpoints.tiny import make_tiny_model
    from tests.gguf_files import WHOLE_BLOCKS

    hf_dir = make_tiny_model(str(tmp_path / "hf"), arch, seed=3, config_overrides=WHOLE_BLOCKS.get(arch))
    path = write_gguf(hf_dir, str(tmp_path / f"{arch}.{qtype}.gguf"), qtype, tensor_types=tensor_types)

    def check(llm):
        layers = llm.engine.executor.worker.model.model.layers
        assert len(layers) == len(expected)
        layer = layers[1]
        assert_layout(layer.self_attn.qkv_proj, qtype)
        assert_layout(layer.self_attn.o_proj, qtype)
        if arch == "qwen2_moe":
            assert_layout(layer.mlp.shared_expert.gate_up_proj, qtype)
            assert_layout(layer.mlp.shared_expert.down_proj, qtype)
        for block, types in zip(layers, expected):
            assert_expert_layout(block.mlp.experts, *types)  # (Mixtral's block_sparse_moe too)

    assert_same(generate(path), generate(path, quantization="gguf", inspect=check))


@pytest.mark.slow  # 50 s on 2 cores: the whole real model from its blocks under the interpreter
def test_the_builtin_smollm2_from_its_q4_1_blocks():
    """The built-in model's file (linears Q4_1, embeddings Q8_0) served from its blocks equals the same file
    dequantized at load (what the built-in model serves by default on CPU, converted to float32)."""
    from checkpoints.builtin import default_gguf_path

    path = default_gguf_path()
    assert_same(generate(path), generate(path, quantization="gguf", inspect=assert_int_layers("Q4_1")))


def test_an_lm_head_of_another_type_leaves_the_linears_int(ggufs):
    """llama.cpp's Q4_0 files keep output.weight in Q6_K: the LM head is dequantized, the linears are int."""
    path = ggufs("llama", "Q4_0", (("output.weight", "Q6_K"),))
    assert_same(generate(path), generate(path, quantization="gguf", inspect=assert_int_layers("Q4_0")))


def _assert_mixed(expected: dict):
    """(layer, module) -> the GGUF type it serves, or None for a float weight."""
    def check(llm):
        layers = llm.engine.executor.worker.model.model.layers
        for (index, name), qtype in expected.items():
            linear = layers[index].get_submodule(name)
            if qtype is None:
                assert linear.weight.dtype == torch.float32 and linear.quant_config is None, (index, name)
            else:
                assert_layout(linear, qtype)
    return check


def test_each_linear_as_its_type_allows(ggufs):
    """A file of mixed types: layer 0's attn_v in Q5_0 beside Q4_0 q/k (one fused matmul of two types: dequantized),
    its ffn_down in Q8_0, layer 1's q/k/v all Q8_0 and its attn_output Q4_1; the rest Q4_0."""
    path = ggufs("llama", "Q4_0", (("blk.0.attn_v.weight", "Q5_0"), ("blk.0.ffn_down.weight", "Q8_0"),
                                   ("blk.1.attn_q.weight", "Q8_0"), ("blk.1.attn_k.weight", "Q8_0"),
                                   ("blk.1.attn_v.weight", "Q8_0"), ("blk.1.attn_output.weight", "Q4_1")))
    check = _assert_mixed({(0, "self_attn.qkv_proj"): None, (0, "self_attn.o_proj"): "Q4_0",
                           (0, "mlp.down_proj"): "Q8_0", (0, "mlp.gate_up_proj"): "Q4_0",
                           (1, "self_attn.qkv_proj"): "Q8_0", (1, "self_attn.o_proj"): "Q4_1",
                           (1, "mlp.down_proj"): "Q4_0"})
    assert_same(generate(path), generate(path, quantization="gguf", inspect=check))


Q4_K_M = (("blk.0.attn_v.weight", "Q6_K"), ("blk.0.ffn_down.weight", "Q6_K"), ("blk.1.attn_q.weight", "Q5_K"),
          ("blk.1.attn_k.weight", "Q5_K"), ("blk.1.attn_v.weight", "Q5_K"), ("blk.1.attn_output.weight", "Q5_1"),
          ("blk.1.ffn_gate.weight", "Q6_K"), ("blk.1.ffn_up.weight", "Q6_K"), ("output.weight", "Q6_K"))


def test_a_k_quant_mix(ggufs):
    """As llama.cpp's Q4_K_M mixes them: Q4_K, with attn_v and ffn_down in Q6_K (layer 0's attn_v beside Q4_K
    q/k: dequantized) and the LM head Q6_K; here also layer 1's q/k/v Q5_K, its gate/up Q6_K (groups of 16) and
    attn_output Q5_1."""
    path = ggufs("llama", "Q4_K", Q4_K_M)
    check = _assert_mixed({(0, "self_attn.qkv_proj"): None, (0, "self_attn.o_proj"): "Q4_K",
                           (0, "mlp.gate_up_proj"): "Q4_K", (0, "mlp.down_proj"): "Q6_K",
                           (1, "self_attn.qkv_proj"): "Q5_K", (1, "self_attn.o_proj"): "Q5_1",
                           (1, "mlp.gate_up_proj"): "Q6_K", (1, "mlp.down_proj"): "Q4_K"})
    assert_same(generate(path), generate(path, quantization="gguf", inspect=check))


def test_no_servable_linear_loads_dequantized(ggufs):
    path = ggufs("llama", "F16")

    def floats(llm):
        assert llm.engine.executor.worker.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32

    assert_same(generate(path), generate(path, quantization="gguf", inspect=floats))


def _dequantized(qweight, scales, mins, qtype: str) -> torch.Tensor:
    """The int layer's float32 W [N, K] of N-first parts (qweight [N, K / p], scales / mins [N, G])."""
    layout = INT_LAYOUTS[qtype]
    p = 32 // layout.bits
    zeros = None
    if not layout.has_mins:
        zeros = torch.full((scales.shape[1], scales.shape[0] // p), _mid_word(layout.bits), dtype=torch.int32)
    return dequantize_ref(qweight.t().contiguous(), zeros, scales.t().contiguous(), None, layout.group_size,
                          offset_binary(layout.bits), torch.float32, None if mins is None else mins.t().contiguous())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # equal bits: -0.0 is not 0.0


@pytest.mark.parametrize("qtype", list(INT_LAYOUTS))
def test_repacked_blocks_dequantize_as_gguf_does(ggufs, qtype):
    """Rows (in Hugging Face order) and column groups of qweight / scales (/ mins) give gguf's own dequantization,
    bit for bit, for the whole tensor and for a rank's slice (inside and across a k-quant's super-blocks)."""
    from checkpoints.gguf import iterate_gguf_weights, linear_module_types, open_gguf

    path = ggufs("llama", qtype)
    layout = INT_LAYOUTS[qtype]
    p, g = 32 // layout.bits, layout.group_size
    weights = dict(iterate_gguf_weights(path, int_modules=set(linear_module_types(open_gguf(path)))))
    floats = dict(iterate_gguf_weights(path))
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        qweight, scales, w = weights[f"{module}.qweight"], weights[f"{module}.scales"], floats[f"{module}.weight"]
        mins = weights.get(f"{module}.mins")
        n, k = w.get_shape()
        assert qweight.get_shape() == [n, k // p] and scales.get_shape() == [n, k // g]
        assert (mins is not None) == layout.has_mins
        for rows, (first, last) in ((slice(None), (0, k)), (slice(16, 48), (k // 2 - 32, k // 2 + 32))):
            qw, sc = qweight[rows, first // p: last // p], scales[rows, first // g: last // g]
            mn = mins[rows, first // g: last // g] if mins is not None else None
            assert qw.dtype == torch.int32 and sc.dtype == getattr(torch, layout.scale_dtype)
            assert torch.equal(_bits(_dequantized(qw, sc, mn, qtype)), _bits(w[rows, first:last]))


def _random_blocks(qtype: str, rows: int, num_blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes [rows, num_blocks, type_size], the fp16 d (dmin, m) finite: every bit pattern of the codes
    and scales (negative Q6_K scales, the top bits of the k-quants' six-bit scales)."""
    import gguf

    rng = np.random.default_rng(seed)
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (rows, num_blocks, size), dtype=np.uint8)
    halves = {"Q6_K": (208,), "Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,)}.get(qtype, (0, 2))
    for at in halves:
        blocks[:, :, at:at + 2] = (rng.standard_normal((rows, num_blocks, 1)) / 64).astype(np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("qtype", list(INT_LAYOUTS))
def test_random_blocks_decode_as_gguf_does(qtype):
    import gguf

    from checkpoints.gguf_blocks import decode_blocks, pack_along_k

    blocks = _random_blocks(qtype, 8, 3)
    want = gguf.quants.dequantize(blocks.reshape(8, -1), gguf.GGMLQuantizationType[qtype])
    q, scales, mins = decode_blocks(qtype, blocks)
    got = _dequantized(pack_along_k(q, INT_LAYOUTS[qtype].bits), torch.from_numpy(scales),
                       None if mins is None else torch.from_numpy(mins), qtype)
    assert torch.equal(_bits(got), _bits(torch.from_numpy(want)))


def _mid_word(bits: int) -> int:
    word = sum((1 << (bits - 1)) << (bits * i) for i in range(32 // bits))
    return word - (1 << 32) if word >= 1 << 31 else word


def test_refusals_and_fallbacks():
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_quantization("gguf", {"architectures": ["LlamaForCausalLM"]})
    assert resolve_quantization("gguf", {"gguf_linear_types": ["F16", "Q3_K"]}) is None  # dequantized at load
    assert resolve_quantization("gguf", {"gguf_linear_types": ["Q3_K", "Q5_0", "Q8_0"]}).method == "gguf"
    assert resolve_quantization("gguf", {"gguf_linear_types": ["Q4_1"]}).has_mins
    config = resolve_quantization("gguf", {"gguf_linear_types": ["Q8_0"]})
    assert (config.method, config.bits, config.group_size, config.has_zero_points) == ("gguf", 8, 32, False)
    config = resolve_quantization("gguf", {"gguf_linear_types": ["Q6_K"]})
    assert (config.bits, config.group_size, config.has_mins, config.scale_dtype) == (8, 16, False, "float32")
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


def test_a_gguf_on_a_gpu_is_dequantized_by_default_until_the_kernels_are_faster(ggufs):
    """Today's default (engine.config.GGUF_BLOCKS_BY_DEFAULT_ON_GPU off: the int kernels' first H200 run was far
    slower than bf16): a .gguf on a GPU is dequantized at load unless --quantization gguf asks for its blocks."""
    from engine.config import GGUF_BLOCKS_BY_DEFAULT_ON_GPU, EngineArgs

    assert not GGUF_BLOCKS_BY_DEFAULT_ON_GPU
    path = ggufs("llama", "Q4_K")
    assert EngineArgs(model=path, device="cuda").create_engine_config().model.quant_config is None
    asked = EngineArgs(model=path, device="cuda", quantization="gguf").create_engine_config().model
    assert asked.quant_config.method == "gguf"


def test_a_gguf_on_a_gpu_is_served_from_its_blocks_by_default(ggufs, tmp_path_factory, monkeypatch):
    """With GGUF_BLOCKS_BY_DEFAULT_ON_GPU on, EngineArgs without quantization: a .gguf on a GPU gets "gguf" (the
    built-in SmolLM2 its Q4_1 file, not the float32 conversion), on CPU none (dequantized at load);
    quantization="none" dequantizes on a GPU too, and is refused for a checkpoint that is quantized. Only the config
    is made ("cuda" is not checked until a worker starts), so this runs here."""
    from checkpoints import int4_rtn as ic
    from checkpoints.builtin import default_gguf_path
    from engine import config
    from engine.config import EngineArgs

    monkeypatch.setattr(config, "GGUF_BLOCKS_BY_DEFAULT_ON_GPU", True)  # the default once the kernels are faster

    def model_config(**kwargs):
        return EngineArgs(**kwargs).create_engine_config().model

    path = ggufs("llama", "Q4_K")
    on_gpu = model_config(model=path, device="cuda")
    assert on_gpu.quantization == "gguf" and on_gpu.quant_config.method == "gguf"
    assert model_config(model=path, device="cpu").quant_config is None
    assert model_config(model=path, device="cuda", quantization="none").quant_config is None
    assert model_config(model=path, device="cuda", quantization="fp8").quant_config.method == "fp8"
    builtin = model_config(device="cuda")
    assert builtin.model == default_gguf_path() and builtin.quant_config.has_mins
    converted = model_config(device="cpu")
    assert not converted.is_gguf and converted.quant_config is None
    tiny = model_config(model="tiny", device="cuda")
    assert tiny.quantization is None and tiny.quant_config is None
    awq, _, _ = int4_factory(tmp_path_factory)(ic.Int4Format("awq", 32))
    assert model_config(model=awq, device="cuda").quant_config.method == "awq"
    with pytest.raises(ValueError, match="quantization='none'.*awq"):
        model_config(model=awq, quantization="none")
