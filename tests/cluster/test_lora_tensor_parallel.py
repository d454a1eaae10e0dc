"""LoRA under tensor parallelism through the engine: two Ray worker actors over gloo, each loading its slices of the
adapters (column-parallel layers their rows of B, row-parallel ones their columns of A), give transformers + peft's
greedy tokens for a batch mixing the base and three adapters through two slots, under preemption, chunked prefill
and prefix-cache hits. Every rank reads each adapter in the background; one whose file is found bad there fails its
own requests only."""

import os
import shutil

import pytest

from pagoda import LLM, LoRARequest
from tests.cluster.test_tensor_parallel import STRESS
from tests.engine.test_lora import assert_completion_matches, greedy, oracle
from tests.lora_adapters import make_adapter
from tests.prompts import PARITY_PROMPTS


@pytest.mark.slow  # 7-18 s of make test's 15 minutes on 2 cores: CI's slow suite runs it
def test_tp2_adapters_match_peft(ray_cluster, tiny_model_dir, tmp_path):
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    loras = [LoRARequest("every", 1, make_adapter(tiny_model_dir, str(tmp_path / "every"), 16, 32.0, every)),
             LoRARequest("qv", 2, make_adapter(tiny_model_dir, str(tmp_path / "qv"), 8, 16.0, ["q_proj", "v_proj"],
                                               seed=1, use_rslora=True)),
             LoRARequest("mlp", 3, make_adapter(tiny_model_dir, str(tmp_path / "mlp"), 8, 16.0,
                                                ["gate_proj", "up_proj", "down_proj"], seed=2))]
    llm = LLM(model=tiny_model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, enable_lora=True,
              max_loras=2, **STRESS)
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        per_prompt = [loras[0], None, loras[1], loras[2], loras[1], loras[1], loras[0]]  # 4, 5: PREFIX under qv
        for _ in range(2):
            outs = llm.generate(PARITY_PROMPTS, greedy(), use_tqdm=False, lora_request=per_prompt)
            for out, lora in zip(outs, per_prompt):
                assert_completion_matches(oracle(tiny_model_dir, lora), out)
            llm.engine.check_integrity()
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits_tokens > 0
        assert llm.engine.lora_slots.num_loads > 3  # three adapters through two slots
        broken = LoRARequest("broken", 4, str(tmp_path / "broken"))  # its header is whole, its tensors cut short
        shutil.copytree(loras[0].path, broken.path)
        weights = os.path.join(broken.path, "adapter_model.safetensors")
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
        mixed = [broken, loras[1], None]
        outs = llm.generate(PARITY_PROMPTS[:3], greedy(), use_tqdm=False, lora_request=mixed)
        assert outs[0].outputs[0].finish_reason == "error" and outs[0].error.param == "lora_request"
        assert "adapter 'broken' (id 4): failed to load" in str(outs[0].error)
        for out, lora in zip(outs[1:], mixed[1:]):
            assert_completion_matches(oracle(tiny_model_dir, lora), out)
        llm.engine.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.slow  # a second tp 2 engine (~25 s) each
@pytest.mark.parametrize("arch, targets", [
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("deepseek_v2", r".*\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"),
])
def test_tp2_family_adapters_match_peft(ray_cluster, tiny_checkpoints, tmp_path, arch, targets):
    """Phi-3's fused qkv_proj / gate_up_proj adapter: each rank cuts the fused B into its q/k/v and gate/up rows.
    DeepSeek-V2's latent attention: q_b_proj and kv_b_proj split by heads (each rank folds its heads' rows of
    kv_b_proj's B into its absorbed queries and outputs), q_a_proj and kv_a_proj_with_mqa whole on every rank."""
    model_dir = tiny_checkpoints[arch]
    lora = LoRARequest(arch, 1, make_adapter(model_dir, str(tmp_path / arch), 8, 16.0, targets))
    llm = LLM(model=model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, enable_lora=True,
              max_lora_rank=8)
    try:
        per_prompt = [lora, None, lora]
        outs = llm.generate(PARITY_PROMPTS[:3], greedy(), use_tqdm=False, lora_request=per_prompt)
        for out, adapter in zip(outs, per_prompt):
            assert_completion_matches(oracle(model_dir, adapter), out)
        llm.engine.check_integrity()
    finally:
        llm.shutdown()
