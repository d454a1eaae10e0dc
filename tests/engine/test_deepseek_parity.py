"""DeepSeek-V2 end to end on CPU: LLM.generate's greedy tokens and logprobs equal transformers' for the tiny
deepseek_v2 (q LoRA, a dense first layer, group-limited routing) and a V2-Lite-shaped one with YaRN (no q LoRA,
greedy routing), under chunked prefill, preemption and prefix-cache hits; an FP8 latent pool, and FP8 linears, against
transformers computing the same definitions; prefixes that come back from the host tier; the pool sized by the latent
layout."""

from __future__ import annotations

import functools

import pytest
import torch

from checkpoints.tiny import make_tiny_model
from pagoda import LLM, SamplingParams
from tests import fp8_oracle
from tests.engine.test_llm_parity import MAX_NEW, assert_same_tokens, hf_reference, run_pagoda
from tests.engines import llm_engine
from tests.prompts import PARITY_PROMPTS
from workers.kv_pool import KVLayout

LITE = {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                            "rope_theta": 1e4, "mscale": 0.707, "mscale_all_dim": 0.707}}
SCHEDULES = {"chunked": dict(block_size=4, max_num_batched_tokens=7),
             "preemption": dict(block_size=4, num_kv_blocks=24),
             "prefix-cached": dict(block_size=4, max_num_seqs=1)}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    # Seed 9: with seed 8 one activation of the FP8 weights-and-KV run lands where the two float32 computations round
    # it to neighbouring e4m3 values and one logprob moves by 0.01 (same tokens; tests/engine/test_fp8_parity.py)
    lite = make_tiny_model(str(tmp_path_factory.mktemp("lite") / "deepseek_v2_lite"), "deepseek_v2", seed=9,
                           config_overrides=LITE)
    return {"tiny": tiny_checkpoints["deepseek_v2"], "lite": lite}


def assert_same_logprobs(model_dir, outs, atol: float = 1e-4) -> None:
    for (_, _, ref_logprobs), out in zip(hf_reference(model_dir), outs):
        for step, entry in enumerate(out.outputs[0].logprobs):
            for tid, logprob in entry.items():
                assert abs(logprob - ref_logprobs[step][tid].item()) < atol, (out.prompt, step, tid)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", ["tiny", "lite"])
def test_parity_across_scheduling(checkpoints, model, schedule):
    model_dir = checkpoints[model]
    llm, outs = run_pagoda(model_dir, **SCHEDULES[schedule])
    assert_same_tokens(model_dir, outs)
    assert_same_logprobs(model_dir, outs)
    if schedule == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if schedule == "prefix-cached":
        assert llm.engine.block_manager.prefix_hits_tokens > 0


# ---- FP8 latent pool -------------------------------------------------------------------------------------------
def _mla_fp8_oracle(model_dir: str, fp8_weights: bool):
    """transformers' model whose attention sees its latents and rope keys quantized to e4m3 and back, with the
    power-of-two scale a layer (and tensor) that Pagoda's calibration batch gives (workers/kv_scales.py); with
    fp8_weights, tests/fp8_oracle.py's fake-quantized linears where Pagoda's are FP8: q_proj or q_b_proj, o_proj,
    the dense MLP and the shared experts, and its W8A8 routed experts (not q_a_proj, kv_a_proj_with_mqa,
    kv_b_proj, routers)."""
    from transformers import AutoModelForCausalLM

    if fp8_weights:
        linears = fp8_oracle.LINEARS
        fp8_oracle.LINEARS = linears + ("q_b_proj",)
        try:
            model = fp8_oracle.oracle_model(model_dir, kv_fp8=False)
        finally:
            fp8_oracle.LINEARS = linears
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for attn in (layer.self_attn for layer in model.model.layers):
        attn.latent_amax, attn.latent_scales = [torch.zeros(()), torch.zeros(())], None

        def expand_kv(latent, k_rot, attn=attn, expand=attn.expand_kv):
            if attn.latent_scales is None:  # calibrating
                attn.latent_amax = [torch.maximum(a, t.abs().amax()) for a, t in zip(attn.latent_amax, (latent, k_rot))]
            else:
                latent, k_rot = (fp8_oracle.fake_quant(t, s) for t, s in zip((latent, k_rot), attn.latent_scales))
            return expand(latent, k_rot)

        attn.expand_kv = expand_kv
    generator = torch.Generator().manual_seed(fp8_oracle.KV_CALIBRATION["seed"])
    ids = torch.randint(0, model.config.vocab_size, (fp8_oracle.KV_CALIBRATION["seqs"],
                                                     fp8_oracle.KV_CALIBRATION["len"]), generator=generator)
    ids[:, 0] = model.config.bos_token_id
    with torch.no_grad():
        model(ids)
    for attn in (layer.self_attn for layer in model.model.layers):
        attn.latent_scales = [fp8_oracle.pow2_at_least(a, 112.0) for a in attn.latent_amax]
    return model


@functools.lru_cache(maxsize=None)
def _fp8_reference(model_dir: str, fp8_weights: bool):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer.encode(p) for p in PARITY_PROMPTS]
    return ids, fp8_oracle.greedy(_mla_fp8_oracle(model_dir, fp8_weights), ids, MAX_NEW)


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["fp8-kv", "fp8-weights-and-kv"])
@pytest.mark.parametrize("model", ["tiny", "lite"])
def test_fp8_latent_pool_matches_the_oracle(checkpoints, model, quantization):
    """Tokens equal, logprobs to 5e-3 (tests/engine/test_fp8_parity.py says why); with preemption."""
    model_dir = checkpoints[model]
    ids, reference = _fp8_reference(model_dir, quantization is not None)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", quantization=quantization,
              block_size=4, num_kv_blocks=24)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.scheduler.num_preemptions > 0
    (worker,) = llm.engine.executor.describe()
    assert worker["kv_cache_dtype"] == "float8_e4m3fn" and len(worker["kv_scales"]) == 2  # a latent, a rope scale
    for (ref_tokens, ref_logprobs), out in zip(reference, outs):
        assert out.outputs[0].token_ids == ref_tokens
        for step, (token_id, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs)):
            assert abs(entry[token_id] - ref_logprobs[step][token_id].item()) < 5e-3
    attn = llm.engine.executor.worker.model.model.layers[0].self_attn
    assert attn.o_proj.weight.dtype == (torch.float8_e4m3fn if quantization else torch.float32)
    assert attn.kv_b_proj.weight.dtype == torch.float32  # the absorbed W_UK / W_UV stay in the model's dtype
    moe = llm.engine.executor.worker.model.model.layers[1].mlp
    assert moe.experts.w13_weight.dtype == moe.experts.w2_weight.dtype == (
        torch.float8_e4m3fn if quantization else torch.float32)  # routed experts: FP8 (W8A8)
    assert moe.gate.weight.dtype == torch.float32
    if model == "tiny" and quantization is None:  # the guard: the float32 pool's logprobs are another computation
        with pytest.raises(AssertionError):
            assert_same_logprobs(model_dir, outs)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "ct-static"])
def test_fp8_checkpoints_match_their_dequantized_oracle(tmp_path, fmt):
    """An FP8 checkpoint of the tiny DeepSeek-V2 (every projection FP8: q_a_proj, q_b_proj, kv_a_proj_with_mqa,
    kv_b_proj, o_proj, the MLPs and experts), served as stored: q_a_proj and kv_a_proj_with_mqa FP8 on every rank,
    kv_b_proj dequantized at load, the experts W8A8; against the oracle on the checkpoint's dequantized weights
    (its kv_b_proj reads its input unquantized, as the absorbed form does)."""
    # Seed 0, not the session's tiny model (seed 8): there one activation of one prompt lands where the two float32
    # computations round it to neighbouring e4m3 values (its logprobs move by up to 0.06, the other prompts' by 0)
    src = make_tiny_model(str(tmp_path / "float"), "deepseek_v2", seed=0)
    model_dir, weights, input_scales = fp8_oracle.write_fp8_checkpoint(src, str(tmp_path / fmt), fmt)
    if fmt.startswith("ct-"):
        _set_ct_ignore(model_dir, ["lm_head", "re:.*mlp.gate$"])
    model = fp8_oracle.oracle_model(src, weights=weights, input_scales=input_scales, kv_fp8=False)
    ids = prompt_ids_of(model_dir)
    reference = fp8_oracle.greedy(model, ids, MAX_NEW)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for (ref_tokens, ref_logprobs), out in zip(reference, outs):
        assert out.outputs[0].token_ids == ref_tokens
        for step, (token_id, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs)):
            assert abs(entry[token_id] - ref_logprobs[step][token_id].item()) < 5e-3
    attn = llm.engine.executor.worker.model.model.layers[0].self_attn
    assert attn.q_a_proj.weight.dtype == attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.quant_config is None
    llm.shutdown()


def _set_ct_ignore(model_dir: str, names: list[str]) -> None:
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] = names
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def prompt_ids_of(model_dir: str) -> list[list[int]]:
    from tests.engine.test_fp8_parity import prompt_ids

    return prompt_ids(model_dir)


@pytest.mark.parametrize("quantization", ["awq", "gptq"])
def test_random_int_weights(checkpoints, quantization):
    """load_format="random" with quantization="awq" / "gptq" (the presets' path): every projection drawn packed,
    q_a_proj and kv_a_proj_with_mqa int on every rank, kv_b_proj the dequantized draw (the initializer's standard
    deviation, 0.3), and the model generates."""
    llm = LLM(model=checkpoints["tiny"], dtype="float32", device="cpu", quantization=quantization,
              load_format="random", num_kv_blocks=64)
    out = llm.generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    attn = llm.engine.executor.worker.model.model.layers[0].self_attn
    assert attn.q_a_proj.qweight.dtype == attn.kv_a_proj_with_mqa.qweight.dtype == torch.int32
    assert attn.kv_b_proj.quant_config is None and abs(attn.kv_b_proj.weight.std().item() - 0.3) < 0.03
    llm.shutdown()


def test_random_int_group_size_fits_deepseek_v2_lite():
    """DeepSeek-V2-Lite's dense intermediate size (10,944) is no multiple of 128: its random AWQ layers take groups
    of 64; Llama-3-8B's keep 128."""
    from checkpoints.presets import PRESETS
    from engine.quantization import resolve_quantization

    lite = resolve_quantization("awq", PRESETS["deepseek-v2-lite"], is_random_weights=True)
    llama = resolve_quantization("awq", PRESETS["llama-3-8b"], is_random_weights=True)
    assert (lite.group_size, llama.group_size) == (64, 128)


# ---- the pool: host tier, sizing ---------------------------------------------------------------------------------
def _greedy(engine, req_id: str, prompt: list[int]) -> tuple[list[int], list]:
    engine.add_request(req_id, {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2), stream=False)
    out = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out = delta
    seq = out.seqs[0]
    return seq.token_ids, [(entry.logprob, [(t, v) for t, _, v in entry.top]) for entry in seq.logprobs]


def test_an_evicted_prefix_comes_back_from_the_host(checkpoints):
    """The host tier holds latent blocks: a prompt evicted from the device pool comes back from it (copied back,
    not recomputed) with the tokens and logprobs of an engine that computes it."""
    small = dict(model=checkpoints["tiny"], dtype="float32", device="cpu", block_size=4, num_kv_blocks=24)
    prompt, others = list(range(5, 45)), [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(3)]
    reference = _greedy(llm_engine(**small, enable_prefix_caching=False), "ref", prompt)
    engine = llm_engine(**small, num_host_kv_blocks=64)
    assert _greedy(engine, "first", prompt) == reference
    for i, other in enumerate(others):
        _greedy(engine, f"other{i}", other)
    tokens, logprobs = _greedy(engine, "again", prompt)  # 4 tokens over 36 copied back: rounding may differ
    assert tokens == reference[0]
    for (logprob, top), (ref_logprob, ref_top) in zip(logprobs, reference[1]):
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert abs(logprob - ref_logprob) < 1e-5 and all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(top, ref_top))
    assert engine.block_manager.host_hits_tokens == 36
    engine.check_integrity()
    engine.shutdown()


def test_the_pool_is_sized_by_the_latent_layout(checkpoints):
    """40 values a token and layer (kv_lora_rank 32 + rope 8), not the 4 heads' expanded K (24) and V (16)."""
    llm = LLM(model=checkpoints["tiny"], dtype="bfloat16", device="cpu", cpu_kv_cache_bytes=4 << 20)
    executor = llm.engine.executor
    assert executor.kv_block_bytes == KVLayout.latent(2, 32, 8).bytes_per_block(16, torch.bfloat16) == 16 * 2 * 40 * 2
    assert executor.num_kv_blocks == (4 << 20) // executor.kv_block_bytes
    k_cache, v_cache = executor.worker.runner.kv_caches[0]
    assert k_cache.shape[1:] == (16, 1, 32) and v_cache.shape[1:] == (16, 1, 8)
    llm.shutdown()
