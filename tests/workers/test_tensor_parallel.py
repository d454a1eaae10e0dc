"""Real tensor parallelism on CPU: two processes joined by gloo run the sharded model of every family; rank 0's
logits must equal the unsharded model's (all-reduce of row-parallel outputs and of MoE blocks' partial sums, masked
vocab-parallel embedding, gathered LM head). One pair of processes runs all families (spawning costs seconds)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from checkpoints.tiny import TINY_ARCHES, make_tiny_model

PROMPTS = [[5, 17, 42, 99, 300, 7, 8], [600, 2, 31]]


def _paged_sequences_class():
    """conftest's PagedSequences, imported by file path (a spawned process has no pytest to provide it)."""
    spec = importlib.util.spec_from_file_location("_workers_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PagedSequences


def _run(paths: list[str], rank: int, world_size: int, init_method: str) -> list[torch.Tensor | None]:
    from workers import parallel
    from workers.weights import load_model

    torch.set_num_threads(1)
    parallel.init_parallel(rank, world_size, backend="gloo", init_method=init_method)
    try:
        if world_size > 1:
            _check_collectives(rank, world_size)
        results = []
        for path in paths:
            model = load_model(_config(path), path, torch.float32, "cpu")
            seqs = _paged_sequences_class()(model, num_seqs=len(PROMPTS))
            prefill = seqs.step([p[:-1] for p in PROMPTS])
            decode = seqs.step([p[-1:] for p in PROMPTS])
            assert (prefill is None) == (decode is None) == (rank != 0)
            results.append(None if prefill is None else torch.cat([prefill, decode]))
        return results
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


def _config(path: str) -> dict:
    if path.endswith(".gguf"):
        from checkpoints.gguf import read_gguf_model

        return read_gguf_model(path).hf_config
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _rank_main(rank, paths, world_size, init_method, out_dir):
    logits = _run(paths, rank, world_size, init_method)
    torch.save(logits, os.path.join(out_dir, f"rank{rank}.pt"))


def test_tp2_matches_tp1(tmp_path):
    # Every family: qwen2's tied embeddings and qkv bias, qwen3's head norms, phi3's fused checkpoint tensors, and
    # the MoE blocks' experts (and qwen2_moe's shared expert) split over the ranks; and a GGUF file, whose ranks
    # dequantize their rows and column blocks, the q/k rows of their heads put back in Hugging Face order; and an MoE
    # GGUF file, whose ranks read their rows (or columns, inside one 32-weight block) of each stacked expert.
    from tests.gguf_files import WHOLE_BLOCKS, write_gguf

    archs = list(TINY_ARCHES)
    paths = [make_tiny_model(str(tmp_path / arch), arch, seed=4) for arch in archs]
    archs.append("llama.gguf")
    paths.append(write_gguf(paths[archs.index("llama")], str(tmp_path / "llama.Q8_0.gguf")))
    moe = make_tiny_model(str(tmp_path / "qwen2_moe-64"), "qwen2_moe", seed=4,
                          config_overrides=WHOLE_BLOCKS["qwen2_moe"])
    archs.append("qwen2_moe.gguf")
    paths.append(write_gguf(moe, str(tmp_path / "qwen2_moe.Q8_0.gguf")))
    expected = _run(paths, 0, 1, None)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_rank_main, args=(paths, 2, init_method, str(tmp_path)), nprocs=2, start_method="spawn")
    assert torch.load(tmp_path / "rank1.pt") == [None] * len(archs)
    for arch, logits, ref in zip(archs, torch.load(tmp_path / "rank0.pt"), expected):
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4, msg=lambda m, arch=arch: f"{arch}: {m}")
