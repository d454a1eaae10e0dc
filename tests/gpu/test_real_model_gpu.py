"""The real default model on a CUDA GPU with the Triton kernels: the answer in the serving dtype (bf16; from its
Q4_1 blocks, the default on a GPU), prompt logprobs and output logprobs against transformers in float32 (CUDA
graphs, overlapped steps, chunked prefill), the GGUF file loaded directly (from its blocks and dequantized), and
tensor parallelism over 3 GPUs from the GGUF (SmolLM2 has 9 heads, 3 KV heads)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from checkpoints.builtin import default_gguf_path  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402
from tests.hf_oracle import assert_matches_hf  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of Japan is", "def add(a, b):\n    return",
           "<|im_start|>user\nName a primary color.<|im_end|>\n<|im_start|>assistant\n",
           "Water boils at a temperature of " * 20]  # 140 tokens: several chunks of 64
SCORED = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, prompt_logprobs=2, logprobs=2)


def test_default_model_answers_in_bf16_with_cuda_graphs():
    llm = LLM(num_kv_blocks=512)  # no model: SmolLM2; auto dtype on a GPU: bfloat16
    assert llm.engine.executor.describe()[0]["cuda_graphs"]
    assert llm.engine.config.model.quantization is None  # dequantized (engine.config.GGUF_BLOCKS_BY_DEFAULT_ON_GPU)
    out = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    llm.shutdown()


@pytest.mark.parametrize("model", ["converted", "gguf", "gguf-dequantized"])
def test_logprobs_match_transformers_in_float32(real_model_dir, model):
    """The GGUF file on a GPU: from its Q4_1 blocks (quantization "gguf"; the int kernels) or dequantized at load
    (quantization "none"); transformers reads the converted checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    path = real_model_dir if model == "converted" else default_gguf_path()
    llm = LLM(model=path, dtype="float32", num_kv_blocks=512, max_num_batched_tokens=64,
              quantization={"gguf": "gguf", "gguf-dequantized": "none"}.get(model))
    assert llm.engine.config.model.quantization == {"gguf": "gguf", "gguf-dequantized": "none"}.get(model)
    outs = llm.generate(PROMPTS, SCORED, use_tqdm=False)
    llm.engine.check_integrity()
    llm.shutdown()
    hf_model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).cuda().eval()
    for out in outs:
        assert_matches_hf(hf_model, out, num_top=2, atol=2e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three CUDA GPUs")
def test_tp3_from_the_gguf_matches_one_gpu(ray_cluster):
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=1, prompt_logprobs=1)
    runs = []
    for tp in (1, 3):
        llm = LLM(model=default_gguf_path(), dtype="float32", num_kv_blocks=512, tensor_parallel_size=tp,
                  use_ray=True)
        runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        llm.shutdown()
    for one, three in zip(*runs):
        assert one.outputs[0].token_ids == three.outputs[0].token_ids
        for a, b in zip(one.prompt_logprobs[1:] + one.outputs[0].logprobs,
                        three.prompt_logprobs[1:] + three.outputs[0].logprobs):
            assert all(abs(lp - b[t]) < 1e-3 for t, lp in a.items())

