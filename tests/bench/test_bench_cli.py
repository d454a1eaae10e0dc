"""`pagoda bench` as a new user meets it: its help lists the benchmarks under its own name, and `latency` with its
default prompt lengths runs on a model whose context they do not fit."""

import json

import pytest

from deploy.cli import main as pagoda


def test_pagoda_bench_help_lists_the_benchmarks_under_its_own_name(capsys):
    from benchmarks.cli import BENCHMARKS

    with pytest.raises(SystemExit) as done:
        pagoda(["bench", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: pagoda bench") and "python -m benchmarks " not in text
    assert all(name in text and help_text.split()[0] in text for name, help_text in BENCHMARKS.items())
    with pytest.raises(SystemExit):
        pagoda(["bench", "latency", "--help"])
    assert capsys.readouterr().out.startswith("usage: pagoda bench latency")
    with pytest.raises(SystemExit) as done:
        pagoda(["bench", "no-such-benchmark"])
    assert done.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_no_prefix_caching_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        pagoda(["serve", "--help"])
    assert "--no-prefix-caching" in capsys.readouterr().out  # the README uses it


def test_bench_latency_fits_a_prompt_length_to_the_model(tmp_path, capsys):
    from benchmarks.latency import fitting_prompt_len

    assert fitting_prompt_len(128, 256, 2048, 64, 8192) == 128
    assert fitting_prompt_len(2048, 1, 2048, 64, 8192) == 2048 - 1 - 64 - 1  # the first token, the decode steps
    assert fitting_prompt_len(2048, 256, 2048, 64, 8192) == 2048 - 1 - 64 - 64  # and 64 steps of chunked prefill
    with pytest.raises(ValueError, match="no room"):
        fitting_prompt_len(128, 1, 64, 64, 8192)
    out = tmp_path / "result.json"
    # the tiny model's context is 2048 tokens, as the default's longest prompt
    assert pagoda(["bench", "latency", "--model", "tiny", "--batch-sizes", "1", "--prompt-lens", "16", "2048",
                   "--decode-steps", "4", "--output-json", str(out)]) == 0
    assert "do not fit this model's 2048-token context: measured with 2042-token prompts" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [r["prompt_len"] for r in rows] == [16, 2042]
    assert all(r["min_running"] == 1 for r in rows)  # no request ended while it was measured
