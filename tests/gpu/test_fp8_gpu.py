"""FP8 on a CUDA GPU: the Triton / cuBLASLt paths against the FP8 oracle (transformers with the same definitions,
on the GPU) and against the torch references; an 8B-shaped model with random FP8 weights: memory and KV blocks."""

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine import LLM, SamplingParams  # noqa: E402
from tests.engine.test_fp8_parity import MAX_NEW, oracle, prompt_ids  # noqa: E402


def greedy_ids(llm, model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids(model_dir)], params, use_tqdm=False)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_fp8_float32_matches_the_oracle(tiny_checkpoints, enforce_eager):
    """float32 activations: the FP8 kernels compute the oracle's definitions up to summation order."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = tiny_checkpoints["llama"]
    llm = LLM(model=model_dir, dtype="float32", device="cuda", quantization="fp8", kv_cache_dtype="fp8",
              enforce_eager=enforce_eager, num_kv_blocks=512)
    assert greedy_ids(llm, model_dir) == [tokens for tokens, _ in oracle(model_dir)]
    llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "mistral-window-8", "qwen3", "phi3", "mixtral"])
def test_gpu_fp8_bf16_kernels_agree_with_the_references(tiny_checkpoints, tmp_path, monkeypatch, arch):
    """bf16, chunked prefill and preemption: what the Triton / cuBLASLt paths generate, scored teacher-forced by
    the torch references (PAGODA_KERNELS=ref): the references' best token at nearly every position, and where not,
    a near tie (bf16 rounding). Teacher-forced, so one flipped tie does not make the rest of a sequence differ.
    Every family's FP8 linears; a window of 8 over the e4m3 pool; Mixtral's bf16 experts."""
    if arch == "mistral-window-8":
        from workers.tiny_model import make_tiny_model

        model_dir = make_tiny_model(str(tmp_path / arch), arch="mistral", seed=2, config_overrides={"sliding_window": 8})
    else:
        model_dir = tiny_checkpoints[arch]
    kwargs = dict(model=model_dir, dtype="bfloat16", device="cuda", quantization="fp8", kv_cache_dtype="fp8",
                  num_kv_blocks=12, block_size=4, max_num_batched_tokens=16)
    llm = LLM(**kwargs)
    ours = greedy_ids(llm, model_dir)
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()
    monkeypatch.setenv("PAGODA_KERNELS", "ref")
    llm = LLM(**{**kwargs, "num_kv_blocks": 64})
    scored = llm.generate([{"prompt_token_ids": p + o} for p, o in zip(prompt_ids(model_dir), ours)],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    llm.shutdown()
    agree, gaps = 0, []
    for prompt, generated, out in zip(prompt_ids(model_dir), ours, scored):
        for position, token in enumerate(generated, start=len(prompt)):
            entry = out.prompt_logprobs[position]  # the token's own logprob and the references' best
            best = max(entry.values())
            agree += entry[token] == best
            gaps.append(best - entry[token])
    assert agree >= 0.9 * len(gaps) and max(gaps) < 0.2, (agree, len(gaps), max(gaps))


def test_gpu_8b_shape_random_fp8_weights_and_pool():
    """Llama-3-8B shapes, random FP8 weights drawn on the GPU: half the bytes of bf16, twice the KV blocks."""
    from workers.presets import preset_dir

    kwargs = dict(model=preset_dir("llama-3-8b"), load_format="random", max_model_len=2048, max_num_seqs=8,
                  enforce_eager=True, gpu_memory_utilization=0.5)
    llm = LLM(quantization="fp8", kv_cache_dtype="fp8", **kwargs)
    model = llm.engine.executor.worker.model
    linear_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "layers" in n
                       and p.dtype == torch.float8_e4m3fn)
    assert 6.9e9 < linear_bytes < 7.1e9, linear_bytes
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8, out[0].outputs[0]
    fp8_blocks = llm.engine.executor.num_kv_blocks
    llm.shutdown()
    del llm, model
    gc.collect()  # the first engine's pool must be gone before the second measures what is free
    torch.cuda.empty_cache()
    llm = LLM(quantization="fp8", **kwargs)
    bf16_blocks = llm.engine.executor.num_kv_blocks
    llm.shutdown()
    assert fp8_blocks > 1.9 * bf16_blocks, (fp8_blocks, bf16_blocks)

