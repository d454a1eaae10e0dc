"""Real tensor parallelism on CPU: two processes joined by gloo run the sharded model; rank 0's logits must equal
the unsharded model's (all-reduce of row-parallel outputs, masked vocab-parallel embedding, gathered LM head)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from workers.tiny_model import make_tiny_model

PROMPTS = [[5, 17, 42, 99, 300, 7, 8], [600, 2, 31]]


def _paged_sequences_class():
    """conftest's PagedSequences, imported by file path (a spawned process has no pytest to provide it)."""
    spec = importlib.util.spec_from_file_location("_workers_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PagedSequences


def _run(path: str, rank: int, world_size: int, init_method: str) -> torch.Tensor | None:
    from workers import parallel
    from workers.weights import load_model

    torch.set_num_threads(1)
    parallel.init_parallel(rank, world_size, backend="gloo", init_method=init_method)
    try:
        if path.endswith(".gguf"):
            from workers.gguf import read_gguf_model

            config = read_gguf_model(path).hf_config
        else:
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
        model = load_model(config, path, torch.float32, "cpu")
        if world_size > 1:
            _check_collectives(rank, world_size)
        seqs = _paged_sequences_class()(model, num_seqs=len(PROMPTS))
        prefill = seqs.step([p[:-1] for p in PROMPTS])
        decode = seqs.step([p[-1:] for p in PROMPTS])
        assert (prefill is None) == (decode is None) == (rank != 0)
        return None if prefill is None else torch.cat([prefill, decode])
    finally:
        parallel.destroy_parallel()


def _check_collectives(rank: int, world_size: int) -> None:
    from workers import parallel

    assert (parallel.get_tp_rank(), parallel.get_tp_size()) == (rank, world_size)
    x = torch.full((2, 1), float(rank))
    assert parallel.all_gather(x, dim=-1).tolist() == [[0.0, 1.0], [0.0, 1.0]]
    gathered = parallel.gather_to_rank0(x, dim=0)
    assert gathered.tolist() == [[0.0], [0.0], [1.0], [1.0]] if rank == 0 else gathered is None
    assert parallel.broadcast_from_rank0(torch.tensor([rank + 10])).item() == 10
    assert parallel.all_reduce(torch.tensor([rank + 1.0])).item() == 3.0


def _rank_main(rank, path, world_size, init_method, out_dir):
    logits = _run(path, rank, world_size, init_method)
    torch.save(logits, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("arch,fmt", [("qwen2", "safetensors"), ("llama", "gguf")])
def test_tp2_matches_tp1(tmp_path, arch, fmt):
    # qwen2: tied embeddings and qkv bias also go through the sharded path. GGUF: each rank dequantizes its rows
    # and column blocks, the q/k rows of its heads put back in Hugging Face order.
    path = make_tiny_model(str(tmp_path / arch), arch, seed=4)
    if fmt == "gguf":
        from tests.gguf_files import write_gguf

        path = write_gguf(path, str(tmp_path / f"{arch}.Q8_0.gguf"))
    expected = _run(path, 0, 1, None)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_rank_main, args=(path, 2, init_method, str(tmp_path)), nprocs=2, start_method="spawn")
    assert torch.load(tmp_path / "rank1.pt") is None
    torch.testing.assert_close(torch.load(tmp_path / "rank0.pt"), expected, atol=1e-5, rtol=1e-5)
