"""The benchmarks as CI smoke tests, on CPU with the tiny model: each runs end to end and writes a JSON result that
holds the figures it reports. (The figures themselves are for GPUs: benchmarks/results, README.) Those that need
the session's Ray cluster or Serve app are in tests/cluster/test_bench_serve.py; these run in make test's parallel
first phase."""

import argparse
import json
import os

import pytest

from deploy.cli import main as pagoda
from tests.bench_cli import run_json as _run


def test_bench_latency(tmp_path):
    result = _run(tmp_path, "bench", "latency", "--model", "tiny", "--batch-sizes", "1", "3",
                  "--prompt-lens", "8", "20", "--decode-steps", "4")
    cases = {(r["batch"], r["prompt_len"]): r for r in result["results"]}
    assert set(cases) == {(1, 8), (1, 20), (3, 8), (3, 20)}
    assert all(r["decode_ms_per_token"] > 0 and r["tokens_per_s"] > 0 for r in cases.values())
    assert all(r["min_running"] == r["batch"] and r["preemptions"] == 0 for r in cases.values())


def test_bench_latency_fp8_reports_its_pool(tmp_path):
    """--quantization fp8 --kv-cache-dtype fp8: the run says what it ran, and the FP8 pool has 4x the blocks of the
    float32 pool that a CPU run would otherwise get (the same 1 GiB)."""
    base = _run(tmp_path, "bench", "latency", "--model", "tiny", "--batch-sizes", "1", "--prompt-lens", "8",
                "--decode-steps", "2")
    fp8 = _run(tmp_path, "bench", "latency", "--model", "tiny", "--batch-sizes", "1", "--prompt-lens", "8",
               "--decode-steps", "2", "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    assert (fp8["quantization"], fp8["kv_cache_dtype"], fp8["workers"][0]["kv_cache_dtype"]) == \
        ("fp8", "fp8", "float8_e4m3fn")
    assert fp8["num_kv_blocks"] == 4 * base["num_kv_blocks"]
    assert fp8["results"][0]["decode_ms_per_token"] > 0


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_bench_latency_int4_random_weights(tmp_path, method):
    """`pagoda bench latency --preset llama-3-8b --quantization awq` at the tiny model's size: random weights and no
    quantization_config give the default int4 layout (group 128: the tiny model widened to K of 128 and 256),
    drawn packed, and the benchmark runs and says what it ran."""
    from checkpoints.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"), "llama", config_overrides={"hidden_size": 128,
                                                                                "intermediate_size": 256})
    result = _run(tmp_path, "bench", "latency", "--model", model, "--load-format", "random", "--quantization",
                  method, "--device", "cpu", "--batch-sizes", "1", "2", "--prompt-lens", "8", "--decode-steps", "2")
    assert result["quantization"] == method
    assert [(r["batch"], r["min_running"]) for r in result["results"]] == [(1, 1), (2, 2)]
    assert all(r["decode_ms_per_token"] > 0 for r in result["results"])


def test_bench_multi_turn_finds_evicted_histories_on_the_host(tmp_path):
    """Six conversations of three turns through a 96-token device pool: with the host tier (written through, or
    back as the pool reuses blocks) their histories, evicted from the device, are found on the host; without it they
    are computed again. Every turn is answered each way."""
    out = tmp_path / "multi_turn.json"
    assert pagoda(["bench", "multi-turn", "--model", "tiny", "--device", "cpu", "--block-size", "4",
                   "--num-kv-blocks", "24", "--swap-space-runs", "0", "0.001", "--kv-offload-policy-runs",
                   "write-through", "write-back", "--num-conversations", "6", "--turns", "3", "--system-len", "24",
                   "--user-len", "8", "--output-len", "4", "--request-rate", "50", "--output-json", str(out)]) == 0
    off, *on = json.loads(out.read_text())["results"]
    assert [r["kv_offload_policy"] for r in (off, *on)] == [None, "write-through", "write-back"]
    assert off["host_hits_tokens"] == 0 and off["num_host_kv_blocks"] == 0
    for run in on:
        assert off["turns"] == run["turns"] == 18 and run["num_host_kv_blocks"] > 0
        assert run["host_hits_tokens"] > 0 and run["offloaded_bytes"] > 0
        assert run["ttft_s"]["p50"] > 0 and run["total_tokens_per_s"] > 0


def test_bench_kv_tier_cost_measures_both_ways_and_recommends_settings(tmp_path):
    """Copies through the worker's host pool, and prompts computed, copied back and computed again: the copied-back
    run onloads every block but the one with the last token, and the recommended flags give the reported threshold."""
    from engine.onload_cost import NEVER_ONLOAD, OnloadCost

    result = _run(tmp_path, "bench", "kv-tier-cost", "--model", "tiny", "--device", "cpu", "--block-size", "4",
                  "--num-kv-blocks", "64", "--swap-space", "0.01", "--prefix-lens", "16", "40", "--copy-blocks", "1",
                  "8", "32", "--repeats", "2")
    assert [r["blocks"] for r in result["copies"]] == [1, 8, 32]
    assert all(r["onload_ms"] > 0 and r["offload_ms"] > 0 for r in result["copies"])
    assert [(r["prefix_len"], r["onloaded_blocks"]) for r in result["prefixes"]] == [(16, 3), (40, 9)]
    assert all(r["computed_ms"] > 0 and r["copied_back_ms"] > 0 and r["computed_again_ms"] > 0
               for r in result["prefixes"])
    threshold = OnloadCost(result["onload_gb_per_s"] * 1e9, result["onload_latency_s"],
                           result["prefill_tokens_per_s"]).min_onload_blocks(4, result["block_bytes_per_rank"])
    assert result["min_onload_blocks"] == ("never" if threshold == NEVER_ONLOAD else threshold)
    assert result["flags"].startswith("--onload-gb-per-s ")
    assert result["fetch_copies_gb_per_s"] > 0
    assert result["fetch_break_even_gb_per_s"] == pytest.approx(
        result["block_bytes_per_rank"] / 4 * result["prefill_tokens_per_s"] / 1e9)


def test_bench_quality_on_the_tiny_model(tmp_path):
    result = _run(tmp_path, "bench", "quality", "--model", "tiny", "--positions", "40", "--quantization", "fp8",
                  "--kv-cache-dtype", "fp8", "--device", "cpu", "--ablations")
    unquantized, quantized, weights_only, kv_only = result["results"]
    assert [r["run"] for r in result["results"][2:]] == ["pagoda, weights fp8, kv auto",
                                                          "pagoda, weights as stored, kv fp8"]
    assert unquantized["positions"] == quantized["positions"] == 40
    assert unquantized["top1_agreement"] == 1.0 and unquantized["max_abs_delta_logprob"] < 1e-3
    for row in (quantized, weights_only, kv_only):
        assert row["mean_abs_delta_logprob"] > 1e-5  # FP8 is a different computation, and it shows


@pytest.mark.parametrize("method, sym", [("awq", None), ("gptq", True), ("gptq", False)])
def test_bench_quality_int4_on_the_tiny_model(tmp_path, method, sym):
    """--quantization awq / gptq on a float model: its round-to-nearest int4 checkpoint (group 128 asked, 64 taken:
    the tiny model's hidden 64), Pagoda on it equal to transformers on the dequantized weights to float tolerance
    (the kernels' error), both far from the unquantized model (the quantization's); the unquantized run exact."""
    sym_flag = [] if sym is None else ["--int4-sym" if sym else "--no-int4-sym"]
    result = _run(tmp_path, "bench", "quality", "--model", "tiny", "--positions", "40", "--quantization", method,
                  *sym_flag, "--device", "cpu", "--dtype", "float32")
    unquantized, int4, dequantized = result["results"]
    assert (int4["run"], dequantized["run"]) == (f"pagoda, weights {method}, kv auto",
                                                  "transformers, int4 weights dequantized")
    assert unquantized["top1_agreement"] == 1.0 and unquantized["max_abs_delta_logprob"] < 1e-3
    info = result["int4"]
    assert (info["group_size"], info["requested_group_size"], info["sym"]) == (64, 128, method == "gptq" and sym)
    assert "group 64: input features [64] are not multiples of 128" in info["checkpoint"]
    qc = info["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"]) == (method, 4, 64)
    assert qc.get("version", "gemm") == "gemm" and not qc.get("desc_act", False)
    kernels = info["pagoda_vs_dequantized"]
    assert kernels["top1_agreement"] == 1.0 and kernels["max_abs_delta_logprob"] < 1e-4
    assert int4["mean_abs_delta_logprob"] > 1e-2  # int4 is another model, and it shows
    assert int4["mean_abs_delta_logprob"] == pytest.approx(dequantized["mean_abs_delta_logprob"], abs=1e-4)


def test_int4_group_size_fits_the_linears_or_is_refused():
    from checkpoints.int4_rtn import fit_group_size

    smollm2 = {"q_proj": 576, "o_proj": 576, "down_proj": 1536}  # SmolLM2-135M's input features
    assert fit_group_size(smollm2, 128) == 64
    assert fit_group_size({"down_proj": 1536}, 128) == 128
    assert fit_group_size(smollm2, -1) == -1
    with pytest.raises(ValueError, match="group_size 128: q_proj has 80 input features"):
        fit_group_size({"q_proj": 80, "down_proj": 1536}, 128)


@pytest.mark.slow  # runs transformers beside Pagoda: ~20 s
def test_bench_throughput_beside_transformers(tmp_path):
    result = _run(tmp_path, "bench", "throughput", "--num-requests", "6", "--input-len-range", "8", "24",
                  "--output-len", "5", "--compare", "hf")
    hf, pagoda_row = result["results"]
    assert (hf["engine"], pagoda_row["engine"]) == ("transformers", "pagoda")
    for row in (hf, pagoda_row):
        assert row["requests"] == 6 and row["total_tokens_per_s"] > row["output_tokens_per_s"] > 0
    assert result["speedup_total_tokens"] == pytest.approx(
        pagoda_row["total_tokens_per_s"] / hf["total_tokens_per_s"])
    assert pagoda_row["engine_steps"]["steps"] >= 5


def test_bench_throughput_sampling_sweep_on_one_engine(tmp_path):
    result = _run(tmp_path, "bench", "throughput", "--num-requests", "4", "--input-len-range", "8", "16",
                  "--output-len", "4", "--no-prefix-caching", "--sampling-sweep", "greedy", "seed",
                  "--profile-steps", "2", "--profile-after", "1")
    greedy, seed = result["results"]
    profile = greedy["profile"]  # steps 2 and 3 of the first setting's run (no kernels on a CPU)
    assert profile["after_steps"] == 1 and profile["wall_ms"] > 0 and profile["tokens_per_step"] >= 1
    assert "profile" not in seed
    assert (greedy["sampling"], seed["sampling"]) == ("greedy", "seed")
    assert seed["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    assert greedy["vs_first"] == 1.0 and seed["vs_first"] == seed["total_tokens_per_s"] / greedy["total_tokens_per_s"]
    assert seed["output_tokens"] == 16 and result["prefix_caching"] is False


def test_bench_sampler(tmp_path):
    result = _run(tmp_path, "bench", "sampler", "--batch-sizes", "3", "--vocab", "300", "--history-len", "16",
                  "--settings", "greedy", "top_p", "seed", "--repeats", "2")
    assert [(r["setting"], r["impl"]) for r in result["results"]] == [
        ("greedy", "pagoda"), ("top_p", "pagoda"), ("top_p", "full sort"), ("seed", "pagoda")]
    assert all(r["host_ms"] > 0 for r in result["results"])


def test_bench_kernels_smoke(tmp_path):
    from benchmarks.kernels import main as kernels

    out = tmp_path / "kernels.json"
    assert kernels(["--smoke", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["failures"]
    assert {r["kernel"] for r in result["results"]} >= {"decode attn", "prefill attn", "linear layer"}


def test_bench_host_step(tmp_path):
    from benchmarks.host_step import add_args, main

    parser = argparse.ArgumentParser()
    add_args(parser)
    out = tmp_path / "host.json"
    result = main(parser.parse_args(["--num-seqs", "8", "--steps", "5", "--prompt-len", "20",
                                     "--output-json", str(out)]))
    assert json.loads(out.read_text()) == result
    assert [r["mode"] for r in result["results"]] == ["final", "delta", "delta+interval", "delta+25ms"]
    assert all(r["host_ms_per_step"] > 0 for r in result["results"])
    runner = main(parser.parse_args(["--num-seqs", "8", "--steps", "5", "--prompt-len", "20", "--executor", "runner",
                                     "--sampling", "greedy", "seed", "--modes", "delta"]))
    assert [(r["executor"], r["sampling"]) for r in runner["results"]] == [("runner", "greedy"), ("runner", "seed")]
    assert all(r["host_ms_per_step_p50"] > 0 for r in runner["results"])


def test_bench_serve_warm_up_sends_every_request_and_fails_on_an_error():
    import asyncio

    from benchmarks.serve import warm_up, warmup_bodies

    args = argparse.Namespace(vocab_size=200, seed=3)
    bodies = warmup_bodies(args, "tiny", 4)
    assert len(bodies) == 4 and all(b["max_tokens"] == 2 and len(b["prompt"]) == 8 and b["stream"] for b in bodies)
    sent = []

    async def send(body):
        sent.append(body)
        return {"ok": True}

    asyncio.run(warm_up(send, bodies))
    assert sent == bodies

    async def refuse(body):
        return {"ok": False, "error": "HTTP 503"}

    with pytest.raises(RuntimeError, match="HTTP 503"):
        asyncio.run(warm_up(refuse, bodies))


def test_bench_spec_decode_compares_with_the_plain_engine(tmp_path):
    result = _run(tmp_path, "bench", "spec-decode", "--model", "tiny", "--device", "cpu", "--block-size", "4",
                  "--num-kv-blocks", "64", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                  "--batch-size", "2", "--max-tokens", "12", "--repeats", "1", "--trace", str(tmp_path / "t.jsonl"))
    (row,) = result["results"]
    assert row["identical"] and row["output_tokens"] > 0 and row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
    assert result["speculative_config"]["num_speculative_tokens"] == 3
    # --trace: the timed run's decisions (one a step, of the batch's requests) and recorded step times
    trace = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    decisions = [t for t in trace if "decide" in t]
    assert decisions and 1 <= max(t["running"] for t in decisions) <= 2
    assert all(0 <= t["decide"] <= t["running"] and isinstance(t["ahead"], bool) for t in decisions)
    assert sum(t["record"] for t in trace if "record" in t) >= row["output_tokens"]  # every token's step timed


def test_bench_spec_decode_with_a_draft_model(tmp_path):
    """The tiny model drafting for itself: every draft accepted, the plain engine's output. (Every step speculates:
    the engine's own choice reads this machine's step times.)"""
    config = '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3, "disable_by_batch_size": 1024}'
    result = _run(tmp_path, "bench", "spec-decode", "--model", "tiny", "--device", "cpu", "--block-size", "4",
                  "--num-kv-blocks", "64", "--speculative-config", config, "--batch-size", "2", "--max-tokens", "12",
                  "--repeats", "1")
    (row,) = result["results"]
    assert row["identical"] and row["output_tokens"] > 0 and row["acceptance"] == 1.0
    assert result["speculative_config"]["method"] == "draft_model"


def test_bench_latency_over_lora_adapters_and_speculation(tmp_path):
    """--lora-adapters with --speculative-config: four engines (base and LoRA, each plain then speculative), every
    case on each; the forced-drafts variant verifies k drafts every step (the verify step's cost)."""
    result = _run(tmp_path, "bench", "latency", "--model", "tiny", "--device", "cpu", "--batch-sizes", "1", "2",
                  "--prompt-lens", "32", "--decode-steps", "4", "--num-kv-blocks", "128", "--lora-adapters", "2",
                  "--lora-rank", "4", "--max-loras", "2",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert [(r["lora"], r["speculative"]) for r in result["runs"]] == [
        ("base", False), ("base", True), ("2 x r4, 2 slots", False), ("2 x r4, 2 slots", True)]
    rows = result["results"]
    assert len(rows) == 2 * (2 + 2 * 2)  # per engine pair: plain (2 batches), speculative (2 batches x 2 variants)
    for row in rows:
        assert row["min_running"] == row["batch"] and row["preemptions"] == 0
        assert row["ms_per_step"] > 0 and row["tokens_per_step"] >= 1.0
    forced = [r for r in rows if r.get("drafts") == "forced"]
    assert len(forced) == 4 and all(r["draft_tokens_per_step"] == 3.0 for r in forced)
    assert all(r["graph_steps"] == 0 for r in forced)  # no CUDA graphs on a CPU (on a GPU: 1.0 up to batch 64)
    assert all(r["tokens_per_step"] == 1.0 for r in rows if not r["speculative"])
    # the n-gram engine's drafts come from its workers' device lookup, in the step: no proposer time before it
    assert all(r["steps_ahead"] > 0 and r["propose_ms_per_step"] == 0 for r in rows if r.get("drafts"))
    # each proposer row against its case's plain and forced rows: the speed-up and the bound that the verify step's
    # cost plus the proposer's allows
    for row in (r for r in rows if r.get("drafts") == "ngram"):
        (plain,) = [r for r in rows if not r["speculative"] and (r["lora"], r["batch"]) == (row["lora"], row["batch"])]
        (verify,) = [r for r in forced if (r["lora"], r["batch"]) == (row["lora"], row["batch"])]
        speedup = plain["decode_ms_per_token"] / row["decode_ms_per_token"]
        verify_ms = verify["ms_per_step"] - verify["propose_ms_per_step"]
        cost = (verify_ms + row["propose_ms_per_step"]) / plain["ms_per_step"]
        bound = row["tokens_per_step"] / cost
        assert (row["speedup"], row["verify_step_cost"], row["step_cost"], row["speedup_bound"], row["of_bound"]) == (
            round(speedup, 3), round(verify_ms / plain["ms_per_step"], 3), round(cost, 3), round(bound, 3),
            round(speedup / bound, 3))
        assert row["step_cost"] == row["verify_step_cost"]
    assert not any("speedup" in r for r in rows if r.get("drafts") != "ngram")


def test_bench_latency_oracle_drafts_are_the_models_own_continuation(tmp_path):
    """--oracle-drafts 1.0: each request's drafts are its own greedy continuation, recorded first, so on the CPU
    (float32: the verify step's argmax is the plain step's) every draft is accepted and each step gives k + 1 tokens;
    the row gets its bound as the proposers' rows do. 0.5: about half the drafts are made wrong."""
    for accuracy, check in (("1.0", lambda r: r["acceptance"] == 1.0 and r["tokens_per_step"] == 4.0),
                            ("0.5", lambda r: 0.05 < r["acceptance"] < 0.7 and 1.0 < r["tokens_per_step"] < 4.0)):
        result = _run(tmp_path, "bench", "latency", "--model", "tiny", "--device", "cpu", "--batch-sizes", "1", "3",
                      "--prompt-lens", "32", "--decode-steps", "6", "--num-kv-blocks", "128", "--oracle-drafts",
                      accuracy, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
        oracle = [r for r in result["results"] if r.get("drafts") == "oracle"]
        assert [r["batch"] for r in oracle] == [1, 3]
        for row in oracle:
            assert row["draft_tokens_per_step"] == 3.0 and check(row) and row["steps_ahead"] > 0, row
            assert row["speedup_bound"] > 0 and row["of_bound"] > 0


def test_bench_latency_refuses_oracle_drafts_without_speculation(capsys):
    assert pagoda(["bench", "latency", "--model", "tiny", "--oracle-drafts", "0.9"]) != 0
    assert "--oracle-drafts P takes a probability in [0, 1] and needs --speculative-config" in capsys.readouterr().err


def test_bench_latency_refuses_more_adapters_than_slots(capsys):
    assert pagoda(["bench", "latency", "--model", "tiny", "--lora-adapters", "3", "--max-loras", "2"]) != 0
    assert "--lora-adapters 3 needs --max-loras >= 3" in capsys.readouterr().err


def test_bench_throughput_over_more_lora_adapters_than_slots_at_two_batch_caps(tmp_path):
    """Three adapters through two GPU slots, each engine at two decode batch caps (--max-num-seqs-runs): every
    request finishes; the LoRA engine's rate is compared with the base engine's at the same cap."""
    result = _run(tmp_path, "bench", "throughput", "--model", "tiny", "--device", "cpu", "--num-requests", "6",
                  "--input-len", "12", "--output-len", "4", "--num-kv-blocks", "128", "--lora-adapters", "3",
                  "--lora-rank", "4", "--max-loras", "2", "--max-num-seqs-runs", "2", "8")
    rows = result["results"]
    assert [(r["lora"], r["max_num_seqs"]) for r in rows] == [
        ("base", 2), ("base", 8), ("3 x r4, 2 slots", 2), ("3 x r4, 2 slots", 8)]
    assert all(r["output_tokens"] == 24 for r in rows)
    assert rows[0]["engine_steps"]["steps"] > rows[1]["engine_steps"]["steps"]  # 2 at a time takes more steps
    assert result["lora_vs_base_total_tokens"] == [
        lora["total_tokens_per_s"] / base["total_tokens_per_s"] for base, lora in zip(rows[:2], rows[2:])]


def test_bench_random_adapters_are_what_peft_reads(tiny_model_dir, tmp_path):
    """The benchmark's random adapters load in peft with every tensor used, change the model's output, and Pagoda
    with one gives peft's greedy tokens."""
    import torch

    from benchmarks.lora_workload import random_adapters
    from pagoda import LLM, SamplingParams
    from tests.lora_adapters import peft_model

    with open(f"{tiny_model_dir}/config.json") as f:
        hf_config = json.load(f)
    (lora,) = random_adapters(hf_config, 1, 4, seed=3, out_dir=str(tmp_path))
    model, base = peft_model(tiny_model_dir, lora.path), peft_model(tiny_model_dir, None)
    tensors = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert len(tensors) == 2 * 7 * hf_config["num_hidden_layers"]  # A and B of every projection of every layer
    prompt = [5, 17, 42, 8, 99, 3]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = model.generate(ids, max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
        assert not torch.equal(model(ids).logits, base(ids).logits)
    llm = LLM(model=tiny_model_dir, dtype="float32", device="cpu", enable_lora=True, max_lora_rank=4)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6,
                                                                         ignore_eos=True), lora_request=lora)
    llm.shutdown()
    assert out.outputs[0].token_ids == want


def test_bench_random_adapters_leave_no_directory_behind(tiny_model_dir, tmp_path):
    """Adapters written without a directory of the caller's go to a temporary one, removed when the process exits
    (the benchmarks' LoRA runs left one in the temp dir each)."""
    import subprocess
    import sys

    script = ("import json, os, sys; from benchmarks.lora_workload import random_adapters; "
              f"(a,) = random_adapters(json.load(open('{tiny_model_dir}/config.json')), 1, 2); "
              "assert os.path.isdir(a.path), a.path; print(a.path)")
    temp = tmp_path / "temp"
    temp.mkdir()
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(temp)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(temp))  # it was written there, and is gone
    assert list(temp.iterdir()) == []


@pytest.mark.slow  # 18 s under CPU: CI's slow suite
def test_bench_host_ops(tmp_path):
    """The ops a step issues, counted by the runner's function: the ahead path's lookup, fix-up and append are one
    launch each with the Triton kernels (under the interpreter), some tens of torch ops each without."""
    import subprocess
    import sys

    results = {}
    for flag in ("", "--kernels"):
        out = tmp_path / f"ops{flag}.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        subprocess.run([sys.executable, "-m", "benchmarks.host_ops", *([flag] if flag else []), "--batch-size", "2",
                        "--max-tokens", "12", "--output-json", str(out)], check=True, env=env, timeout=600,
                       capture_output=True)
        results[flag] = {row["way"]: row for row in json.loads(out.read_text())["rows"]}
    references, kernels = results[""]["ahead"], results["--kernels"]["ahead"]
    assert references["steps_ahead"] > 0 and results[""]["pipelined"]["steps_ahead"] == 0
    for name in ("lookup", "fix_up", "history.append"):
        assert kernels["by_function"][name] <= 1.0 < references["by_function"][name], name
    assert kernels["host_ops_per_step"] < references["host_ops_per_step"] / 2
