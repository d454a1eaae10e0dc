"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints (dense, and MoE with int4 experts) under tensor
parallelism on CPU: two Ray worker actors over gloo, each reading only its slice of the packed tensors
(column-parallel: its output columns, whole int32s; row-parallel: its input rows and their groups, its g_idx
numbered from its first group, or every group under act-order and with one group). Under preemption, chunked
prefill and prefix-cache hits (tests/cluster/test_tensor_parallel.py's stress settings), the tokens equal, and
logprobs agree to 1e-4 with, one rank on the dequantized float32 checkpoint.
"""

import pytest

from checkpoints import int4_rtn as ic
from tests.cluster.test_tensor_parallel import STRESS
from tests.engine.test_gguf_int import Q4_K_M, gguf_factory
from tests.engine.test_int4_checkpoints import assert_same, generate, int4_factory
from tests.engine.test_moe_int4 import moe_int4_factory

# slow: a dozen tp 2 Ray runs, 8-9 s each on 2 cores (make test-slow and CI run them)
pytestmark = pytest.mark.slow

STRESS_INT4 = {**STRESS, "num_kv_blocks": 16}  # the parity prompts preempt in 16 blocks of 4 tokens, not in 24


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    return int4_factory(tmp_path_factory)


@pytest.mark.parametrize("fmt", [ic.Int4Format("awq", 32), ic.Int4Format("gptq", 32, sym=True),
                                 ic.Int4Format("gptq", 32, desc_act=True), ic.Int4Format("gptq", -1, sym=True),
                                 ic.Int4Format("pack-quantized", 32, sym=True),
                                 ic.Int4Format("pack-quantized", 32, sym=False, desc_act=True)],
                         ids=lambda f: f.name)
def test_tp2_int4_equals_one_rank_on_the_dequantized_checkpoint(ray_cluster, int4_checkpoint, fmt):
    dst, oracle, _ = int4_checkpoint(fmt)

    def check(llm):
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits_tokens > 0

    outs = generate(dst, inspect=check, tensor_parallel_size=2, **STRESS_INT4)
    assert_same(generate(oracle), outs)


@pytest.mark.parametrize("arch, fmt", [("qwen2_moe", ic.Int4Format("awq", 32)),
                                       ("mixtral", ic.Int4Format("gptq", 32, desc_act=True)),
                                       ("deepseek_v2", ic.Int4Format("awq", 32))],
                         ids=["qwen2_moe-awq-g32", "mixtral-gptq-g32-act", "deepseek_v2-awq-g32"])
def test_tp2_moe_int4_experts_equal_one_rank_on_the_dequantized_checkpoint(ray_cluster, tmp_path_factory, arch, fmt):
    """Quantized experts at tp 2: each rank its 32 (Qwen2-MoE, DeepSeek-V2) / 128 (Mixtral) columns of every
    expert's gate/up rows and down columns (AWQ g32: its own groups; GPTQ act-order: every group, its g_idx slice),
    and Qwen2-MoE's and DeepSeek-V2's int4 shared experts beside them; DeepSeek-V2's latent attention: each rank its
    heads' rows of q_b_proj and kv_b_proj (dequantized at load) and columns of o_proj, q_a_proj and
    kv_a_proj_with_mqa whole on both."""
    dst, oracle = moe_int4_factory(tmp_path_factory)(arch, fmt)

    def check(llm):
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits_tokens > 0

    outs = generate(dst, inspect=check, tensor_parallel_size=2, **STRESS_INT4)
    assert_same(generate(oracle), outs)


def test_a_row_parallel_slice_inside_a_group_is_refused(ray_cluster, int4_checkpoint):
    """group 128 over o_proj's 128 inputs: a rank's 64 would split the group."""
    dst, _, _ = int4_checkpoint(ic.Int4Format("awq", 128))
    with pytest.raises(Exception, match="tensor_parallel_size 2.*group_size 128"):
        generate(dst, tensor_parallel_size=2)


MIXED = (("blk.0.attn_v.weight", "Q5_0"), ("blk.0.ffn_down.weight", "Q8_0"), ("blk.1.attn_output.weight", "Q4_1"))


# Mixtral's experts from their blocks: gate/up Q8_0, down Q4_1 (minimums), each rank its 128 of 256 columns
MOE_MIXED = tuple((f"blk.{i}.ffn_down_exps.weight", "Q4_1") for i in range(2))


@pytest.mark.parametrize("arch, qtype, types", [("llama", "Q4_0", ()), ("llama", "Q4_1", ()), ("llama", "Q8_0", ()),
                                                ("llama", "Q4_0", MIXED), ("llama", "Q4_K", Q4_K_M),
                                                ("mixtral", "Q8_0", MOE_MIXED)],
                         ids=["Q4_0", "Q4_1", "Q8_0", "mixed", "k-quants", "mixtral-experts"])
def test_tp2_gguf_blocks_equal_one_rank_on_the_dequantized_file(ray_cluster, tmp_path_factory, arch, qtype, types):
    """quantization="gguf": each rank repacks only its rows and column groups of the served linears (in a mixed
    file, each linear as its type allows; a k-quant's o_proj rank reads half a 256-weight super-block) and of the
    routed experts (gate/up rows, down's column groups)."""
    path = gguf_factory(tmp_path_factory)(arch, qtype, types)

    def check(llm):
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert llm.engine.config.model.quant_config.method == "gguf"  # what the ranks build their layers from
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits_tokens > 0

    outs = generate(path, inspect=check, tensor_parallel_size=2, quantization="gguf", **STRESS_INT4)
    assert_same(generate(path), outs)


def test_tp2_phi3_fused_awq_equals_one_rank_on_the_dequantized_checkpoint(ray_cluster, tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj packed as one AWQ linear each: every rank takes its q, k, v (16 of
    k's and v's 32 rows: 2 packed int32 columns) and gate, up slices of the packed columns."""
    from checkpoints.tiny import make_tiny_model
    from tests.engine.test_int4_checkpoints import PHI3_SHAPE

    tiny = make_tiny_model(str(tmp_path / "float"), "phi3", seed=6, config_overrides=PHI3_SHAPE)
    fmt = ic.Int4Format("awq", 32)
    dst, oracle = str(tmp_path / fmt.name), str(tmp_path / f"{fmt.name}-oracle")
    ic.write_int4_checkpoint(tiny, dst, oracle, fmt)
    assert_same(generate(oracle), generate(dst, tensor_parallel_size=2, **STRESS_INT4))
