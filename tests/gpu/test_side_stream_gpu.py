"""Work beside the main stream in the decode CUDA graphs (workers/side_stream.py): each adapted linear's LoRA
shrink beside the layer's own matmul, and the shared experts beside the routed ones (Qwen2-MoE, DeepSeek-V2). The
tokens and logprobs are the one-stream engine's, bit for bit (the shrink's split-K sums are added in a fixed
order), graphed and eager; LoRA with adapter rows beside base rows, in float32 and bfloat16."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagoda import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.lora_adapters import make_adapter  # noqa: E402
from workers import side_stream  # noqa: E402

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "def fibonacci(n: int) -> list[int]:",
           "Once upon a time there was a small model.", "1 2 3", "What is the capital of France?"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (24, 17, 30, 9, 12, 20)]


def _generate(model_dir, lora, overlap: bool, eager: bool, dtype: str, monkeypatch, **kwargs):
    monkeypatch.setattr(side_stream, "OVERLAP", overlap)
    llm = LLM(model=model_dir, device="cuda", dtype=dtype, block_size=16, num_kv_blocks=256, enforce_eager=eager,
              **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=lora)
    graphs = llm.engine.executor.worker.runner.graphs
    replays = 0 if graphs is None else graphs.num_replays
    llm.engine.check_integrity()
    llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_lora_shrink_beside_the_matmul_gives_the_one_stream_output(tiny_checkpoints, tmp_path, dtype,
                                                                         monkeypatch):
    model_dir = tiny_checkpoints["llama"]
    adapters = [LoRARequest(name, i + 1, make_adapter(model_dir, str(tmp_path / name), 8, 16.0, modules, seed=i))
                for i, (name, modules) in enumerate([("a", ["q_proj", "v_proj", "down_proj"]),
                                                     ("b", ["k_proj", "o_proj", "gate_proj", "up_proj"])])]
    lora = [adapters[0], None, adapters[1], adapters[0], None, adapters[1]]
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
    base, _ = _generate(model_dir, None, False, True, dtype, monkeypatch, **kwargs)
    for eager in (True, False):
        one_stream, _ = _generate(model_dir, lora, False, eager, dtype, monkeypatch, **kwargs)
        assert [t for t, _ in one_stream] != [t for t, _ in base]  # the adapters change the output
        overlapped, replays = _generate(model_dir, lora, True, eager, dtype, monkeypatch, **kwargs)
        assert (replays > 0) == (not eager)
        assert overlapped == one_stream


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_shared_experts_beside_the_routed_ones_give_the_one_stream_output(tiny_checkpoints, arch, dtype,
                                                                               monkeypatch):
    one_stream, _ = _generate(tiny_checkpoints[arch], None, False, False, dtype, monkeypatch)
    overlapped, replays = _generate(tiny_checkpoints[arch], None, True, False, dtype, monkeypatch)
    assert replays > 0
    assert overlapped == one_stream
