"""The engine on a CUDA GPU with the Triton kernels: parity with transformers, CUDA graphs against eager."""

import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagoda import LLM, SamplingParams  # noqa: E402

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. A language model reads a prompt",
           "def fibonacci(n: int) -> list[int]:", "Once upon a time there was a small model that wanted to learn.",
           "1 2 3", "What is the capital of France? Paris is the capital."]


def greedy(llm, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=1)
    return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module")
def hf_tokens(tiny_checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoints["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)], device="cuda")
        seq = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_greedy_parity_with_transformers(tiny_checkpoints, hf_tokens, enforce_eager):
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cuda", block_size=16,
              enforce_eager=enforce_eager, num_kv_blocks=512)
    outs = greedy(llm)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    llm.engine.check_integrity()
    llm.shutdown()


def test_gpu_chunked_prefill_preemption_and_prefix_cache(tiny_checkpoints, hf_tokens):
    llm = LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cuda", block_size=16,
              num_kv_blocks=7, max_num_batched_tokens=32, max_num_seqs=4)
    outs = greedy(llm)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_integrity()
    llm.shutdown()


def test_gpu_bf16_graphs_match_eager_logprobs(tiny_checkpoints):
    eager = LLM(model=tiny_checkpoints["qwen2"], dtype="bfloat16", device="cuda", enforce_eager=True,
                num_kv_blocks=512)
    ref = greedy(eager, 8)
    eager.shutdown()
    graphs = LLM(model=tiny_checkpoints["qwen2"], dtype="bfloat16", device="cuda", num_kv_blocks=512)
    got = greedy(graphs, 8)
    graphs.shutdown()
    for a, b in zip(ref, got):
        first_a, first_b = a.outputs[0], b.outputs[0]
        assert first_a.token_ids[0] == first_b.token_ids[0]  # the prefill path is the same
        lp_a = first_a.logprobs[0][first_a.token_ids[0]]
        lp_b = first_b.logprobs[0][first_b.token_ids[0]]
        assert abs(lp_a - lp_b) < 0.05


def _sleep_cycles_for(seconds: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for about `seconds`, measured on this device."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1000 / start.elapsed_time(end))


def test_gpu_greedy_penalties_match_transformers(tiny_checkpoints):
    """Penalties from the device token histories (the sampling kernel, overlapped steps) against transformers with
    vLLM's definition as a logits processor, both on the GPU in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    from tests.engine.test_penalties import vllm_penalties

    torch.backends.cuda.matmul.allow_tf32 = False
    path, penalties = tiny_checkpoints["llama"], dict(repetition_penalty=1.3, frequency_penalty=-0.6,
                                                      presence_penalty=0.4)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)], device="cuda")
        seq = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id,
                             logits_processor=LogitsProcessorList([vllm_penalties(ids.shape[1], **penalties)]))
        expected.append(seq[0, ids.shape[1]:].tolist())
    llm = LLM(model=path, dtype="float32", device="cuda", num_kv_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, **penalties)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    llm.engine.check_integrity()
    llm.shutdown()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3, max_tokens=16, ignore_eos=True,
                   logit_bias={5: 1.0}),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1, frequency_penalty=0.2,
                   presence_penalty=0.1, max_tokens=16, ignore_eos=True),
], ids=["greedy-logprobs", "sampled-filters-seed-bias", "seed-guide-penalties"])
def test_gpu_overlapped_step_launches_without_waiting_for_the_device(tiny_checkpoints, params):
    """With the device busy (a 0.5 s spin queued on the stream), a decode step must still return at once: it
    launches step N+1 behind the spin and reads step N, queued before it. Any host-to-device copy from pageable
    memory, or any read that waits for the whole stream (`.tolist()` of a device tensor), would wait for the
    spin."""
    llm = LLM(model=tiny_checkpoints["llama"], dtype="bfloat16", device="cuda", num_kv_blocks=512)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):
        engine.step()  # prefill done, decoding, one step in flight
    torch.cuda.synchronize()
    spin_s = 0.5
    torch.cuda._sleep(_sleep_cycles_for(spin_s))
    before = sum(len(seq.output_token_ids) for g in engine.groups.values() for seq in g.seqs)
    start = time.perf_counter()
    engine.step()
    launched_s = time.perf_counter() - start
    torch.cuda.synchronize()
    after = sum(len(seq.output_token_ids) for g in engine.groups.values() for seq in g.seqs)
    assert after == before + len(PROMPTS), "the step in flight should have given every request a token"
    assert launched_s < spin_s / 5, f"the step waited {launched_s:.3f} s for the device"
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    llm.shutdown()


def test_shutdown_gives_the_gpu_memory_back(tiny_checkpoints):
    """An engine shut down frees its weights, KV pool and graphs: a second engine in the same process (a notebook,
    a test) sizes its pool from the memory free again, rather than failing with 'no memory left for the KV cache'."""
    path = tiny_checkpoints["llama"]
    torch.cuda.synchronize()
    free_before, total = torch.cuda.mem_get_info()
    for _ in range(2):
        llm = LLM(model=path, device="cuda", gpu_memory_utilization=0.5)
        assert len(greedy(llm, max_tokens=4)) == len(PROMPTS)
        assert torch.cuda.mem_get_info()[0] < free_before - 0.2 * total  # it took its pool
        llm.shutdown()
        assert torch.cuda.mem_get_info()[0] > free_before - 2**30, "the pool was not given back"
