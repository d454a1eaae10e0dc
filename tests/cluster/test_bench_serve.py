"""The benchmarks that need the session's Ray cluster or Serve app, as CI smoke tests (the others:
tests/bench/test_bench_smoke.py): `pagoda bench serve` against the running app, and a replica's cold start."""

import time

import pytest

from tests.bench_cli import run_json as _run


@pytest.mark.parametrize("rate, client", [("inf", ["--client", "openai", "--client-processes", "2"]),
                                          pytest.param("20", ["--client", "aiohttp"], marks=pytest.mark.slow),
                                          pytest.param("inf", ["--client", "openai", "--structured", "json-schema"],
                                                       marks=pytest.mark.slow)])
def test_bench_serve_against_the_running_app(tmp_path, serve_url, auth, rate, client):
    api_key = auth["Authorization"].removeprefix("Bearer ")
    before = time.time()
    result = _run(tmp_path, "bench", "serve", "--url", serve_url, "--api-key", api_key, "--model", "tiny",
                  "--num-prompts", "6", "--input-len-range", "8", "24", "--output-len", "5", *client,
                  "--request-rate", rate, "--max-concurrency", "4", "--vocab-size", "200", "--seed", str(len(rate)),
                  "--warmup-requests", "3")
    # the warm-up requests (3, by each client process) ran before the clock and are not counted
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["warmup_requests"] == 3 and before < result["started_at_unix_s"] < time.time()
    assert result["client"] == client[1]
    assert result["structured"] == ("json-schema" if "--structured" in client else None)
    assert result["total_tokens_per_s"] > result["output_tokens_per_s"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < result[metric]["p50"] <= result[metric]["p99"]
    assert result["e2e_ms"]["p50"] >= result["ttft_ms"]["p50"]


@pytest.mark.slow
def test_bench_cold_start(tmp_path, ray_cluster):
    """A replica's start-up as Serve runs it, on the session's cluster: every phase measured, twice."""
    result = _run(tmp_path, "bench", "cold-start", "--num-kv-blocks", "64", "--repeat", "2")
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        phases = run["phases"]
        assert {"replica_process", "engine_scheduled", "engine.process", "engine.imports", "engine.weights",
                "engine.kv_alloc", "engine.tokenizer_wait", "engine.ready", "first_token"} <= set(phases), phases
        assert all(v >= 0 for v in phases.values())
        assert 0 < phases["engine.weights"] and 0 < phases["first_token"]
        # the phases account for the whole start (each is measured, not derived from the total)
        assert sum(phases.values()) == pytest.approx(run["placed_to_first_token_s"], rel=0.1, abs=1.0)
        # the tokenizer loaded beside them, within the engine's start
        tokenizer = run["overlapped"]["engine.tokenizer"]
        assert 0 < tokenizer["cpu_s"] and 0 < tokenizer["wall_s"] < run["placed_to_first_token_s"]
