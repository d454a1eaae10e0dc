"""The structured-output benchmarks as smoke tests on CPU (the figures are for the H200): `--structured
json-schema` beside the plain run in throughput and latency, and the grammar host cost alone."""

import json

import pytest

from benchmarks.structured import main as structured_host
from tests.bench_cli import run_json as _run


@pytest.mark.slow  # ~11 s
def test_bench_throughput_structured(tmp_path):
    result = _run(tmp_path, "bench", "throughput", "--num-requests", "4", "--input-len-range", "8", "16",
                  "--output-len", "6", "--structured", "json-schema", "--device", "cpu")
    plain, constrained = result["results"]
    assert (plain["structured"], constrained["structured"]) == (None, "json-schema")
    assert plain["output_tokens"] == constrained["output_tokens"] == 4 * 6  # the schema cannot end earlier
    assert constrained["grammar_compiles"] == 1 and constrained["mask_ms_per_step"] > 0
    assert constrained["mask_rows_per_step"] > 1
    assert result["structured_vs_plain_output_tokens"] == [
        constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]]


@pytest.mark.slow  # ~15 s
def test_bench_latency_structured(tmp_path):
    result = _run(tmp_path, "bench", "latency", "--batch-sizes", "2", "--prompt-lens", "8", "--decode-steps", "3",
                  "--structured", "json-schema")
    plain, constrained = result["results"]
    assert "structured" not in plain and constrained["structured"] == "json-schema"
    assert constrained["mask_steps"] >= 3 and constrained["mask_rows_per_step"] == 2


def test_bench_structured_host_cost(tmp_path):
    out = tmp_path / "host.json"
    result = structured_host(["--rows", "1", "20", "--steps", "3", "--vocab-size", "1100", "--fill-threads", "1",
                              "2", "--output-json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(r["rows"], r["fill_threads"]) for r in result["results"]] == [(1, 1), (1, 1), (20, 1), (20, 2)]
    assert all(r["mask_ms_per_step"] > 0 and r["tokenizer_tokens"] == 1000 for r in result["results"])
