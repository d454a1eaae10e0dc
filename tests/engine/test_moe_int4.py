"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints of Mixtral, Qwen2-MoE and Qwen3-MoE served as stored,
the routed experts too (packed int32s stacked per layer, dequantized tile by tile in kernels/moe_quant.py; on CPU its
reference dequantizes the experts a step chose).

checkpoints/int4_rtn.py quantizes a tiny model of each family round-to-nearest and packs every linear, each
expert's w1/w3/w2 (gate_proj/up_proj/down_proj) and Qwen2-MoE's shared expert included, as AutoAWQ, GPTQModel and
llm-compressor pack them; routers and shared_expert_gate stay float, as the tools leave them. The oracle is
transformers on the same model with the dequantized weights (a float32 checkpoint in the original per-expert
layout): prompt and output logprobs and greedy tokens (tests/hf_oracle.py).
"""

import functools
import re

import pytest
import torch

from checkpoints import int4_rtn as ic
from engine.quantization import resolve_quantization
from pagoda import LLM, SamplingParams
from tests.hf_oracle import assert_matches_hf
from tests.prompts import PARITY_PROMPTS

# Groups of 32 / 64 fit every K (hidden 128, expert intermediate 64 or 256); at tp 2 a rank's 32 expert columns are
# whole groups of 32 and whole int32s of AWQ's packed columns.
SHAPES = {"mixtral": {"hidden_size": 128, "intermediate_size": 256},
          "qwen2_moe": {"hidden_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
          "qwen3_moe": {"hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 256},
          "deepseek_v2": {"moe_intermediate_size": 64}}
# What the tools write beside the packing: AutoAWQ's Mixtral class keeps "gate" (the router) in float; AWQ skips a
# module whose name contains an entry, so Qwen2-MoE's router needs "mlp.gate" ("gate" would also skip gate_proj);
# llm-compressor's MoE recipes ignore the routers by regex. GPTQModel quantizes only the modules it lists.
IGNORED = {("awq", "mixtral"): {"modules_to_not_convert": ["gate"]},
           ("awq", "qwen2_moe"): {"modules_to_not_convert": ["mlp.gate", "shared_expert_gate"]},
           ("pack-quantized", "qwen2_moe"): {"ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]},
           ("pack-quantized", "qwen3_moe"): {"ignore": ["lm_head", "re:.*mlp.gate$"]},
           ("pack-quantized", "deepseek_v2"): {"ignore": ["lm_head", "re:.*mlp.gate$"]}}
CASES = [("mixtral", ic.Int4Format("awq", 32)), ("mixtral", ic.Int4Format("gptq", 32, desc_act=True)),
         ("qwen2_moe", ic.Int4Format("awq", 64)), ("qwen2_moe", ic.Int4Format("pack-quantized", 32, desc_act=True)),
         ("qwen2_moe", ic.Int4Format("gptq", 32, desc_act=True, checkpoint_format="gptq_v2")),
         ("qwen3_moe", ic.Int4Format("gptq", 64, bits=8, sym=True)),
         ("qwen3_moe", ic.Int4Format("pack-quantized", 32, sym=True)), ("qwen3_moe", ic.Int4Format("gptq", -1)),
         # DeepSeek-V2's latent attention too: q_a_proj / kv_a_proj_with_mqa int on every rank, kv_b_proj
         # dequantized at load
         ("deepseek_v2", ic.Int4Format("awq", 32)), ("deepseek_v2", ic.Int4Format("gptq", 32, desc_act=True)),
         ("deepseek_v2", ic.Int4Format("pack-quantized", 32, sym=True))]
MAX_NEW = 6


def moe_int4_factory(tmp_path_factory):
    """(arch, fmt) -> (int checkpoint, its dequantized float32 checkpoint), written once."""
    from checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("moe-int4")

    @functools.lru_cache(maxsize=None)
    def tiny(arch: str) -> str:
        return make_tiny_model(str(root / arch), arch, seed=5, config_overrides=SHAPES[arch])

    @functools.lru_cache(maxsize=None)
    def checkpoint(arch: str, fmt: ic.Int4Format) -> tuple[str, str]:
        dst, oracle = str(root / f"{arch}-{fmt.name}"), str(root / f"{arch}-{fmt.name}-oracle")
        ic.write_int4_checkpoint(tiny(arch), dst, oracle, fmt)
        ic.set_quantization_config(dst, {**fmt.quantization_config(), **IGNORED.get((fmt.method, arch), {})})
        return dst, oracle

    checkpoint.tiny = tiny  # type: ignore[attr-defined]
    return checkpoint


@pytest.fixture(scope="module")
def moe_int4(tmp_path_factory):
    return moe_int4_factory(tmp_path_factory)


def generate(model_dir: str, inspect=None, **kwargs):
    kwargs.setdefault("num_kv_blocks", 256)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2, prompt_logprobs=2)
    try:
        outs = llm.generate(PARITY_PROMPTS, params, use_tqdm=False)
        llm.engine.check_integrity()
        if inspect is not None:
            inspect(llm)
        return outs
    finally:
        llm.shutdown()


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def assert_packed_experts(llm) -> None:
    """Every routed expert and linear held as packed int32s; only norms, biases, routers, shared_expert_gate and
    MLA's kv_b_proj (dequantized at load: read as matrices) in float."""
    model = llm.engine.executor.worker.model
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert experts and all(e.w13_qweight.dtype == e.w2_qweight.dtype == torch.int32 for e in experts)
    floats = [name for name, p in model.model.layers.named_parameters() if p.is_floating_point()
              and not name.endswith(("scales", "bias", "norm.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                                     "kv_b_proj.weight"))]
    assert not floats, f"float weights: {floats}"


@pytest.mark.parametrize("arch, fmt", CASES, ids=lambda c: c if isinstance(c, str) else c.name)
def test_logprobs_and_tokens_equal_transformers_on_the_dequantized_weights(moe_int4, arch, fmt):
    """Also the layout the experts hold once loaded: 4 bits without act-order (GPTQ, pack-quantized) repacked along N
    in AWQ's order, as the dense layers are (workers/layers/moe_quant.py `finish_int_experts`); the rest as stored."""
    dst, oracle = moe_int4(arch, fmt)

    def inspect(llm):
        assert_packed_experts(llm)
        along_n = fmt.method == "awq" or (fmt.bits == 4 and not fmt.desc_act)
        model = llm.engine.executor.worker.model
        experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
        for proj in (p for e in experts for p in e.projections.values()):
            assert proj.packing.is_packed_along_k != along_n, (fmt.name, proj.name, proj.packing)

    outs = generate(dst, inspect=inspect)
    model = hf_model(oracle)
    for out in outs:
        assert_matches_hf(model, out, num_top=2, atol=act_order_atol(fmt))


def act_order_atol(fmt: ic.Int4Format) -> float:
    """Logprob tolerance against transformers: an act-order layer sorted by group sums K in group order, transformers
    in the checkpoint's, so float32 rounds differently (each as near the exact product: 4e-7 of it on a 512 x 512
    layer); through the tiny MoE models that moved logprobs by up to 1.4e-4, against 1.6e-5 unsorted."""
    return 3e-4 if fmt.desc_act else 1e-4


def test_the_oracle_differs_from_the_float_model(moe_int4):
    """The test above compares with the quantized model, not the float one: it could fail."""
    dst, _ = moe_int4("mixtral", CASES[0][1])
    out = generate(dst)[1]
    with pytest.raises(AssertionError):
        assert_matches_hf(hf_model(moe_int4.tiny("mixtral")), out, num_top=2, atol=1e-3)


def test_a_shared_expert_the_tool_left_in_float_loads_as_stored(moe_int4, tmp_path):
    """An ignore list naming Qwen2-MoE's whole shared expert (llm-compressor's "re:.*shared_expert.*"): built
    unquantized, its float weights loaded as stored, the routed experts int4; equal to transformers."""
    fmt = ic.Int4Format("pack-quantized", 32)
    dst, oracle = str(tmp_path / "ct"), str(tmp_path / "ct-oracle")
    ic.write_int4_checkpoint(moe_int4.tiny("qwen2_moe"), dst, oracle, fmt, float_modules=("shared_expert.",))
    ic.set_quantization_config(dst, {**fmt.quantization_config(),
                                     "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert.*"]})

    def check(llm):
        block = llm.engine.executor.worker.model.model.layers[1].mlp
        assert block.experts.w13_qweight.dtype == torch.int32
        assert block.shared_expert.gate_up_proj.weight.dtype == torch.float32
        assert block.shared_expert.gate_up_proj.quant_config is None

    model = hf_model(oracle)
    for out in generate(dst, inspect=check):
        assert_matches_hf(model, out, num_top=2, atol=1e-4)


def test_random_weights_are_drawn_packed(moe_int4):
    """load_format="random" on a quantized MoE's config: experts drawn as packed integers whose dequantized weights
    have the initializer's standard deviation (0.3); the model generates."""
    dst, _ = moe_int4("qwen2_moe", ic.Int4Format("awq", 64))

    def check(llm):
        from workers.layers.moe_quant import quantized_experts

        experts = llm.engine.executor.worker.model.model.layers[1].mlp.experts
        for projection in quantized_experts(experts):
            w = torch.stack([projection.dequantize(e, torch.float32) for e in range(projection.num_experts)])
            assert abs(w.std().item() - 0.3) < 0.02

    generate(dst, inspect=check, load_format="random")


def moe_config(arch: str, qc: dict) -> dict:
    from checkpoints.tiny import TINY_ARCHES

    fields = TINY_ARCHES[arch][2]
    return {"architectures": [TINY_ARCHES[arch][1]], "num_hidden_layers": 2, "quantization_config": qc, **fields}


@pytest.mark.parametrize("arch, qc, field", [
    ("qwen2_moe", {**ic.Int4Format("awq").quantization_config(), "modules_to_not_convert": ["gate"]},
     "'gate' matches model.layers.0.mlp.experts.0.gate_proj (AWQ skips every module whose name contains"),
    ("qwen3_moe", {**ic.Int4Format("awq").quantization_config(), "modules_to_not_convert": ["mlp.gate"]},
     "'mlp.gate' matches model.layers.0.mlp.gate_proj"),  # mlp_only_layers [0]: a dense gate_proj
    ("qwen3_moe", {**ic.Int4Format("pack-quantized").quantization_config(), "ignore": ["re:.*experts.*"]},
     "'re:.*experts.*' matches model.layers.1.mlp.experts.0.gate_proj"),
    ("mixtral", {**ic.Int4Format("gptq").quantization_config(), "modules_to_not_convert": ["w2"]},
     "'w2' matches model.layers.0.block_sparse_moe.experts.0.w2"),
    ("qwen2_moe", {**ic.Int4Format("pack-quantized").quantization_config(), "ignore": ["re:.*shared_expert.up_proj"]},
     "'re:.*shared_expert.up_proj' matches model.layers.0.mlp.shared_expert.up_proj")],  # a part of it: refused
    ids=["qwen2_moe-autoawq-gate", "qwen3_moe-awq-dense-gate_proj", "qwen3_moe-ct-experts", "mixtral-gptq-w2",
         "qwen2_moe-ct-part-of-shared-expert"])
def test_ignore_lists_naming_quantized_modules_are_refused(arch, qc, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        resolve_quantization(None, moe_config(arch, qc))


def test_routers_norms_and_the_lm_head_may_be_ignored():
    """What the tools leave in float: Qwen3-30B-A3B-FP8 lists every layer's norms and router by name (and a whole
    shared expert: the test above)."""
    names = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(2)
                           for m in ("input_layernorm", "mlp.gate", "post_attention_layernorm")]
    config = resolve_quantization(None, moe_config("qwen3_moe", {**ic.Int4Format("gptq").quantization_config(),
                                                                 "modules_to_not_convert": names}))
    assert config.method == "gptq" and config.ignored == tuple(names)
