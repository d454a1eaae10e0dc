"""Multi-LoRA serving against transformers + peft: adapters written by peft (random, non-zero B) on the tiny model
give, through `LLM.generate(..., lora_request=...)`, transformers + peft's greedy tokens and logprobs, alone and in
a batch mixed with the base and other adapters, under chunked prefill, prefix caching, preemption and more adapters
than GPU slots; a bad adapter is a ValueError that names it, and the engine goes on serving."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from pagoda import LLM, LoRARequest, SamplingParams
from tests.hf_oracle import assert_matches_hf, hf_logprobs
from tests.lora_adapters import edit_config, make_adapter, peft_model
from tests.prompts import PARITY_PROMPTS, PREFIX
from tests.spec_proposers import OracleProposer

MAX_NEW = 8
ATOL = 1e-4
# name -> (rank, alpha, targets, rsLoRA): ranks 8 and 16, different target subsets (fused q/k/v and gate/up
# slices alone and together, a regex), rsLoRA
ADAPTERS = {
    "qv": (8, 16.0, ["q_proj", "v_proj"], False),
    "all": (16, 32.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp-rs": (8, 8.0, ["up_proj", "down_proj", "o_proj"], True),
    "regex": (16, 16.0, r".*\.(k_proj|gate_proj)", False),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """LoRARequest of each ADAPTERS entry (ids 1, 2, ...), written by peft."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, i + 1, make_adapter(tiny_model_dir, str(root / name), rank, alpha, targets,
                                                         seed=i, use_rslora=rs))
            for i, (name, (rank, alpha, targets, rs)) in enumerate(ADAPTERS.items())}


@functools.lru_cache(maxsize=None)
def _oracle(model_dir: str, adapter_dir: str | None):
    return peft_model(model_dir, adapter_dir)


def oracle(model_dir: str, lora: LoRARequest | None):
    return _oracle(model_dir, None if lora is None else lora.path)


def greedy(prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2,
                          prompt_logprobs=prompt_logprobs)


def lora_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model=model_dir, dtype="float32", device="cpu", enable_lora=True, **kwargs)


def assert_completion_matches(model, out) -> None:
    """Each output token is transformers + peft's greedy choice, with its logprob (teacher-forced)."""
    completion = out.outputs[0]
    assert len(completion.token_ids) == MAX_NEW, f"{out.prompt!r}: {completion.finish_reason}"  # a failed request too
    ref = hf_logprobs(model, out.prompt_token_ids + completion.token_ids)
    for j, token_id in enumerate(completion.token_ids):
        row = ref[len(out.prompt_token_ids) - 1 + j]
        assert token_id == row.argmax().item(), f"{out.prompt!r}: output token {j} is not the oracle's greedy choice"
        assert abs(completion.logprobs[j][token_id] - row[token_id].item()) < ATOL, f"output token {j}"


def step_until(engine, condition, max_steps: int = 20_000) -> None:
    """Steps the engine until `condition()` (adapters are read in the background: a request of one not yet read
    waits some steps). The bound only stops a broken engine."""
    for _ in range(max_steps):
        if condition():
            return
        engine.step()
    raise AssertionError(f"not reached in {max_steps} steps")


def run_and_check(llm: LLM, model_dir: str, prompts: list[str], loras: list[LoRARequest | None], params=None):
    outs = llm.generate(prompts, params or greedy(), use_tqdm=False, lora_request=loras)
    for out, lora in zip(outs, loras):
        assert_completion_matches(oracle(model_dir, lora), out)
    llm.engine.check_integrity()
    return outs


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = lora_llm(tiny_model_dir, max_loras=4)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_alone_matches_peft(llm, tiny_model_dir, adapters, name):
    lora = adapters[name]
    outs = llm.generate(PARITY_PROMPTS, greedy(prompt_logprobs=2), use_tqdm=False, lora_request=lora)
    base = llm.generate(PARITY_PROMPTS, greedy(), use_tqdm=False)
    model = oracle(tiny_model_dir, lora)
    for out in outs:
        assert_matches_hf(model, out, num_top=2, atol=ATOL)  # prompt logprobs too: every prefill position
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, base)), "no effect"
    llm.engine.check_integrity()


def test_mixed_batch_of_base_and_three_adapters(tiny_model_dir, adapters):
    """Base rows and rows of three adapters in the same steps: each row equals its own single run (and peft)."""
    llm = lora_llm(tiny_model_dir, max_loras=3)
    loras = [None, adapters["qv"], adapters["all"], adapters["mlp-rs"]]
    prompts = [p for p in PARITY_PROMPTS[:4] for _ in loras]
    mixed_loras = loras * 4
    mixed = run_and_check(llm, tiny_model_dir, prompts, mixed_loras)
    assert llm.engine.lora_slots.num_loads == 3  # all three resident together: one step ran them all
    for prompt, lora, out in zip(prompts, mixed_loras, mixed):
        alone = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=lora)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        for a, b in zip(alone.outputs[0].logprobs, out.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < ATOL for t in a)


def test_chunked_prefill(tiny_model_dir, adapters):
    llm = lora_llm(tiny_model_dir, max_loras=2, max_num_batched_tokens=8, max_num_seqs=4)
    loras = [adapters["all"], None, adapters["qv"], adapters["all"]] * 2
    run_and_check(llm, tiny_model_dir, PARITY_PROMPTS[:len(loras)], loras[:len(PARITY_PROMPTS)])


def test_prefix_cache_never_shares_blocks_across_adapters(tiny_model_dir, adapters):
    """The base's cached prompt is no hit for an adapter, nor one adapter's for another; each hits its own."""
    llm = lora_llm(tiny_model_dir, max_loras=2, block_size=4)
    engine = llm.engine
    prompt = PREFIX + "What is the capital of France?"
    loras = [None, adapters["qv"], adapters["all"]]
    run_and_check(llm, tiny_model_dir, [prompt], [None])  # the base's blocks of the prompt are cached now
    ids = [engine.add_request(None, prompt, greedy(), lora_request=lora) for lora in loras[1:]]
    first, second = (engine.scheduler.requests[i] for i in ids)
    step_until(engine, lambda: first in engine.scheduler.running and second in engine.scheduler.running)
    assert first.num_cached_tokens == second.num_cached_tokens == 0  # not the base's, nor each other's
    tables = [set(engine.block_manager._tables[i]) for i in ids]
    assert tables[0] and tables[1] and not tables[0] & tables[1]
    while engine.has_unfinished_requests():
        engine.step()
    hits_before = engine.block_manager.prefix_hits_tokens
    outs = run_and_check(llm, tiny_model_dir, [prompt] * 3, loras)  # now each hits its own, and equals peft's
    assert all(o.metrics.num_cached_tokens >= 16 for o in outs)
    assert engine.block_manager.prefix_hits_tokens - hits_before == sum(o.metrics.num_cached_tokens for o in outs)


def test_preemption(tiny_model_dir, adapters):
    llm = lora_llm(tiny_model_dir, max_loras=2, block_size=4, num_kv_blocks=24)
    loras = [adapters["qv"], adapters["all"], None, adapters["qv"], adapters["all"], None, adapters["all"]]
    run_and_check(llm, tiny_model_dir, PARITY_PROMPTS, loras)
    assert llm.engine.scheduler.num_preemptions > 0


def test_speculative_decoding_with_adapters(tiny_model_dir, adapters):
    """Drafts verified under each row's adapter: speculative greedy output equals the plain run's (which equals
    peft's), with base and adapter rows in the same steps and most drafts accepted."""
    loras = [None, adapters["qv"], adapters["all"], adapters["mlp-rs"]]
    prompts = PARITY_PROMPTS[:4]
    llm = lora_llm(tiny_model_dir, max_loras=3)
    plain = run_and_check(llm, tiny_model_dir, prompts, loras)
    llm.shutdown()
    references = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in plain]
    llm = lora_llm(tiny_model_dir, max_loras=3,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "disable_by_batch_size": 64})  # every step speculates, whatever it costs
    llm.engine.spec.proposer = OracleProposer(references, 3)
    spec = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
    llm.engine.check_integrity()
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < ATOL for t in x)
    llm.shutdown()


def test_more_adapters_than_gpu_slots(tiny_model_dir, adapters):
    """Four adapters through two slots: requests wait for a slot (none fails), the slots are reloaded (LRU), and
    every output is its adapter's."""
    llm = lora_llm(tiny_model_dir, max_loras=2, max_cpu_loras=2)
    names = list(ADAPTERS)
    loras = [adapters[names[i % 4]] for i in range(8)] + [None]
    prompts = [PARITY_PROMPTS[i % len(PARITY_PROMPTS)] for i in range(len(loras))]
    outs = run_and_check(llm, tiny_model_dir, prompts, loras)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.lora_slots.num_loads >= 4
    # ... and again, in the other order: adapters come back from the host cache or their files
    run_and_check(llm, tiny_model_dir, prompts[::-1], loras[::-1])


def test_an_adapter_on_a_moe_model_and_qwen3(tiny_checkpoints, tmp_path):
    """Attention adapters on an MoE family (its experts take none) and on Qwen3 (head norms, its own head_dim)."""
    for arch in ("mixtral", "qwen3"):
        model_dir = tiny_checkpoints[arch]
        lora = LoRARequest(arch, 1, make_adapter(model_dir, str(tmp_path / arch), 8, 16.0,
                                                 ["q_proj", "k_proj", "v_proj", "o_proj"]))
        llm = lora_llm(model_dir)
        run_and_check(llm, model_dir, PARITY_PROMPTS[:3], [lora, None, lora])
        llm.shutdown()


def test_bad_adapters_are_refused_and_the_engine_serves_on(tiny_model_dir, adapters, tmp_path):
    llm = lora_llm(tiny_model_dir, max_loras=2, max_lora_rank=8)
    good = adapters["qv"]
    missing_weights = str(tmp_path / "no-weights")
    shutil.copytree(good.path, missing_weights)
    os.remove(os.path.join(missing_weights, "adapter_model.safetensors"))
    dora = make_adapter(tiny_model_dir, str(tmp_path / "dora"), 8, 16.0, ["q_proj"], use_dora=True)
    biased = str(tmp_path / "bias")
    shutil.copytree(good.path, biased)
    edit_config(biased, bias="all")
    from checkpoints.tiny import make_tiny_model

    wider = make_tiny_model(str(tmp_path / "wider"), config_overrides={"intermediate_size": 96})
    wrong_shape = make_adapter(wider, str(tmp_path / "wrong-shape"), 8, 16.0, ["down_proj"])
    cases = [
        (LoRARequest("nowhere", 11, str(tmp_path / "nowhere")), "adapter_config.json"),
        (LoRARequest("no-weights", 12, missing_weights), "adapter_model.safetensors"),
        (LoRARequest("too-big", 13, adapters["all"].path), "max_lora_rank"),
        (LoRARequest("wrong-shape", 14, wrong_shape), "down_proj.lora_A.weight"),
        (LoRARequest("dora", 15, dora), "DoRA"),
        (LoRARequest("biased", 16, biased), "bias"),
    ]
    for lora, what in cases:
        with pytest.raises(ValueError, match=what) as info:
            llm.generate(["Hello"], greedy(), use_tqdm=False, lora_request=lora)
        assert repr(lora.name) in str(info.value)
        assert not llm.engine.has_unfinished_requests()
    run_and_check(llm, tiny_model_dir, PARITY_PROMPTS[:3], [good, None, good])
    with pytest.raises(ValueError, match=f"id {good.id} is adapter 'qv'"):  # one id, one adapter
        llm.generate(["Hello"], greedy(), use_tqdm=False, lora_request=LoRARequest("other", good.id, biased))


def test_lora_needs_enable_lora(tiny_model_dir, adapters):
    llm = LLM(model=tiny_model_dir, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(["Hello"], greedy(), use_tqdm=False, lora_request=adapters["qv"])


def test_engine_args_validation():
    from engine.config import EngineArgs

    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(enable_lora=True, max_lora_rank=0)
    assert EngineArgs(enable_lora=True, max_loras=3).lora_config().max_cpu_loras == 3
    assert EngineArgs().lora_config() is None


def test_real_model_with_an_adapter(real_model_dir, tmp_path):
    """SmolLM2-135M with an adapter on every projection, against transformers + peft."""
    lora = LoRARequest("smol", 1, make_adapter(real_model_dir, str(tmp_path / "smol"), 16, 32.0,
                                               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"], b_std=0.02))
    llm = lora_llm(real_model_dir, num_kv_blocks=64)
    prompts = ["The capital of Japan is", "Water boils at a temperature of"]
    outs = llm.generate(prompts, greedy(prompt_logprobs=2), use_tqdm=False, lora_request=lora)
    base = llm.generate(prompts, greedy(), use_tqdm=False)
    model = peft_model(real_model_dir, lora.path)
    for out in outs:
        assert_matches_hf(model, out, num_top=2, atol=2e-4)
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, base)), "no effect"
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_decode_with_adapters(tiny_model_dir, adapters):
    """bf16 on a GPU: decode steps replayed from CUDA graphs (which always carry the LoRA slots) give the eager
    engine's tokens, for a batch mixing the base and two adapters."""
    loras = [None, adapters["qv"], adapters["all"]] * 2
    prompts = PARITY_PROMPTS[:len(loras)]
    outs = []
    for eager in (False, True):
        llm = LLM(model=tiny_model_dir, dtype="float32", device="cuda", enable_lora=True, max_loras=2,
                  enforce_eager=eager)
        assert (llm.engine.executor.describe()[0]["cuda_graphs"]) == (not eager)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False,
                                                                   lora_request=loras)])
        llm.shutdown()
    assert outs[0] == outs[1]


class _OracleLoRA(torch.nn.Module):
    """A (fake-quantized) linear plus a LoRA delta computed from its unquantized input, as Pagoda's adapters read
    the model-dtype activations beside an FP8 base."""

    def __init__(self, inner, a: torch.Tensor, b: torch.Tensor, scaling: float):
        super().__init__()
        self.inner, self.a, self.b, self.scaling = inner, a.float(), b.float(), scaling

    def forward(self, x):
        return self.inner(x) + ((x.float() @ self.a.T @ self.b.T) * self.scaling).to(x.dtype)


def test_fp8_base_with_an_adapter(tiny_model_dir, adapters):
    """An FP8 base (weights and per-token activations e4m3) with a float32 adapter on every projection, against the
    FP8 oracle (tests/fp8_oracle.py) with the adapter's delta added to each linear."""
    from safetensors.torch import load_file

    from engine.lora import ATTENTION_MODULES, parse_tensor_name, read_adapter
    from tests import fp8_oracle

    lora = adapters["all"]
    model = fp8_oracle.oracle_model(tiny_model_dir, kv_fp8=False)
    tensors = load_file(os.path.join(lora.path, "adapter_model.safetensors"))
    scaling = read_adapter(lora, _config(tiny_model_dir), 64).scaling
    for name, a in tensors.items():
        layer, module, kind = parse_tensor_name(name)
        if kind == "A":
            parent = model.model.layers[layer].get_submodule("self_attn" if module in ATTENTION_MODULES else "mlp")
            b = tensors[name.replace("lora_A", "lora_B")]
            setattr(parent, module, _OracleLoRA(getattr(parent, module), a, b, scaling))
    llm = lora_llm(tiny_model_dir, quantization="fp8", num_kv_blocks=256)
    ids = [llm.get_tokenizer().encode(p) for p in PARITY_PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False, lora_request=lora)
    for (ref_tokens, ref_logprobs), out in zip(fp8_oracle.greedy(model, ids, MAX_NEW), outs):
        assert out.outputs[0].token_ids == ref_tokens
        for step, (token_id, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs)):
            assert abs(entry[token_id] - ref_logprobs[step][token_id].item()) < 5e-3, step  # as test_fp8_parity
    llm.shutdown()


def _config(model_dir: str) -> dict:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def test_an_adapter_whose_file_breaks_after_it_was_checked_fails_alone(tiny_model_dir, adapters, tmp_path):
    """Checked at add_request, then its weights file truncated before the worker reads it: its request fails with
    an error (the slot is left empty, not holding the adapter before), the base and other adapters' requests in the
    same steps finish with their own outputs."""
    broken_dir = str(tmp_path / "broken")
    shutil.copytree(adapters["all"].path, broken_dir)
    broken = LoRARequest("broken", 9, broken_dir)
    llm = lora_llm(tiny_model_dir, max_loras=2)
    run_and_check(llm, tiny_model_dir, ["Hello"], [adapters["qv"]])  # slot 0: qv
    run_and_check(llm, tiny_model_dir, ["Hello"], [adapters["mlp-rs"]])  # slot 1
    llm.engine.lora_adapter(broken)  # read and checked
    path = os.path.join(broken_dir, "adapter_model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    outs = llm.generate(PARITY_PROMPTS[:3], greedy(), use_tqdm=False, lora_request=[broken, None, adapters["qv"]])
    assert outs[0].outputs[0].finish_reason == "error"
    for out, lora in zip(outs[1:], [None, adapters["qv"]]):
        assert_completion_matches(oracle(tiny_model_dir, lora), out)
    run_and_check(llm, tiny_model_dir, PARITY_PROMPTS[:2], [adapters["mlp-rs"], None])  # the slot takes another
    llm.shutdown()


def test_phi3_adapters_on_its_fused_projections(tiny_checkpoints, tmp_path):
    """Phi-3's checkpoint fuses q/k/v and gate/up, so peft's adapters target qkv_proj and gate_up_proj: one A for
    the fused output, whose B rows Pagoda cuts into its q/k/v and gate/up slices (and o_proj, down_proj as usual)."""
    model_dir = tiny_checkpoints["phi3"]
    lora = LoRARequest("phi3", 1, make_adapter(model_dir, str(tmp_path / "phi3"), 8, 16.0,
                                               ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    llm = lora_llm(model_dir, max_lora_rank=8)
    run_and_check(llm, model_dir, PARITY_PROMPTS[:3], [lora, None, lora])
    llm.shutdown()


@pytest.mark.parametrize("q_lora", [True, False], ids=["q-lora", "q-proj"])
def test_deepseek_v2_adapters_on_its_latent_attention(tiny_checkpoints, tmp_path, q_lora):
    """DeepSeek-V2's attention projections as peft targets them, kv_b_proj included: its delta is folded into the
    absorbed queries and outputs per token and head (workers/lora.py LatentLoRAWeights), beside base rows; with a
    q LoRA (q_a_proj, q_b_proj) and without (V2-Lite's q_proj). Its MLPs take none: an adapter on them is refused
    naming a tensor (peft 0.21 turns gate/up/down targets into the experts' parameters, 0.22 also targets the dense
    first layer's and the shared experts' projections)."""
    from checkpoints.tiny import make_tiny_model

    model_dir = (tiny_checkpoints["deepseek_v2"] if q_lora else
                 make_tiny_model(str(tmp_path / "lite"), arch="deepseek_v2", seed=3,
                                 config_overrides={"q_lora_rank": None}))
    q_targets = "q_a_proj|q_b_proj" if q_lora else "q_proj"
    lora = LoRARequest("mla", 1, make_adapter(model_dir, str(tmp_path / "mla"), 8, 16.0,
                                              rf".*\.({q_targets}|kv_a_proj_with_mqa|kv_b_proj|o_proj)"))
    llm = lora_llm(model_dir, max_lora_rank=8)
    outs = run_and_check(llm, model_dir, PARITY_PROMPTS[:3], [lora, None, lora])
    base = llm.generate(PARITY_PROMPTS[:3], greedy(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids != base[0].outputs[0].token_ids, "no effect"
    if q_lora:
        experts = LoRARequest("experts", 2, make_adapter(model_dir, str(tmp_path / "experts"), 8, 16.0,
                                                         ["gate_proj", "up_proj", "down_proj"]))
        edit_config(experts.path, rank_pattern={}, alpha_pattern={})  # (peft's own for the experts' parameters)
        with pytest.raises(ValueError, match=r"layers\.\d+\.mlp\.(experts|\w+_proj)"):
            llm.generate(PARITY_PROMPTS[:1], greedy(), use_tqdm=False, lora_request=experts)
    llm.shutdown()
