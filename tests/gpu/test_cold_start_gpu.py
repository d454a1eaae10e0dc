"""A replica's start-up on a GPU: every phase recorded where it runs (engine/startup.py), and Triton's on-disk
kernel cache reused by the next replica (benchmarks/cold_start.py, `pagoda bench cold-start`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


def test_cold_start_phases_and_kernel_cache(tmp_path):
    out = tmp_path / "cold.json"
    # A process of its own: the bench starts a Ray cluster whose processes read TRITON_CACHE_DIR as they start.
    subprocess.run([sys.executable, "-m", "benchmarks", "cold-start", "--repeat", "2", "--kernel-cache", "fresh",
                    "--output-json", str(out)], cwd=REPO, check=True, timeout=900)
    result = json.loads(out.read_text())
    first, second = (run["phases"] for run in result["runs"])
    for phases in (first, second):
        assert phases["engine.weights"] > 0 and phases["engine.kv_profile"] > 0
        assert phases["engine.cuda_graphs"] > 0 and phases["engine.warm_up"] > 0
    for run in result["runs"]:  # the critical path adds up; the tokenizer loaded beside it (captures did not fail)
        assert sum(run["phases"].values()) == pytest.approx(run["placed_to_first_token_s"], rel=0.05, abs=1.0)
        assert 0 < run["overlapped"]["engine.tokenizer"]["wall_s"] < run["placed_to_first_token_s"]
    assert any(Path(result["kernel_cache"]).rglob("*.cubin")), "Triton wrote no kernel to the cache"
    # the second replica compiles nothing: its graph capture and warm-up are faster than the first's
    compiled = ("engine.cuda_graphs", "engine.warm_up")
    assert sum(second[p] for p in compiled) < sum(first[p] for p in compiled)
