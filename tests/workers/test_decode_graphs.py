"""Decode graphs over short contexts' block tables (workers/cuda_graphs.py): which batch sizes get one, and steps
through them without a GPU, with tests/cpu_graphs.py's stand-in that replays each "graph" as an eager call over the
views it was captured with (torch.cuda.CUDAGraph cannot run here; tests/gpu has the real ones)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine import SamplingParams
from kernels.fp8 import FP8_DTYPE
from kernels.paged_attention import SHORT_CONTEXT_TOKENS, decode_config
from tests.cpu_graphs import CpuGraphRunner
from workers.layers.attention import short_table_batches

CPU = torch.device("cpu")  # counted as an H200's 132 SMs by the kernels' heuristics


def _tiny(**kwargs):
    from pagoda import LLM

    return LLM(**({"model": "tiny", "device": "cpu", "num_kv_blocks": 96, "block_size": 4} | kwargs))


def test_short_tables_get_graphs_where_an_e4m3_cache_takes_other_tiles():
    llm = _tiny(dtype="bfloat16")
    model = llm.engine.executor.worker.runner.model
    attn = next(m for m in model.modules() if hasattr(m, "sliding_window"))
    assert (attn.num_kv_heads, attn.head_dim) == (2, 16)
    batches = [1, 8, 64, 128, 256, 512]
    # Over an 8k table, batch 128 launches 128 x 2 heads x 2 splits = 512 programs (more than two an SM: 128-key
    # tiles); over a short one a single split, so 256 programs, 64-key tiles and 5 stages. From 256 on, 64-key
    # against 128-key tiles. Below, both tables launch 64-key tiles, deep pipelines: no second graph.
    assert short_table_batches(model, FP8_DTYPE, batches, 8192, CPU) == [128, 256, 512]
    assert decode_config(16, torch.bfloat16, 512 * 2, CPU, kv_fp8=True, max_context=SHORT_CONTEXT_TOKENS) \
        != decode_config(16, torch.bfloat16, 512 * 2, CPU, kv_fp8=True, max_context=8192)
    # a bf16 pool keeps 64-key tiles: only batch 128's pipeline depth differs (one split, so few programs: 5 stages)
    assert short_table_batches(model, torch.bfloat16, batches, 8192, CPU) == [128]
    assert short_table_batches(model, FP8_DTYPE, batches, SHORT_CONTEXT_TOKENS, CPU) == []  # no wider table
    assert short_table_batches(nn.Linear(2, 2), FP8_DTYPE, batches, 8192, CPU) == []  # no per-head attention
    llm.shutdown()


def _run(prompts, params, short_cols: int | None, **kwargs):
    llm = _tiny(**kwargs)
    runner = llm.engine.executor.worker.runner
    if short_cols is not None:
        runner.graphs = CpuGraphRunner(runner.model, runner.kv_caches, runner.buffers,
                                        llm.engine.config.scheduler.max_num_seqs, 0, short_cols, lambda b: b[1:])
        runner.graphs.capture()
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    llm.shutdown()
    return outs, runner


def test_decode_steps_take_the_short_table_graph_while_every_context_fits_it():
    """Four sequences whose contexts grow past the short table (3 blocks of 4 tokens) mid-run: the steps of a batch
    of more than one sequence whose contexts all fit replay the short graph, the others the full one (batch 1 has
    no short graph here), and tokens and logprobs equal the eager run's."""
    prompts = [[5, 6, 7], [11, 12], [20, 21, 22, 23, 24], list(range(30, 45))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (14, 6, 9, 5)]
    eager, _ = _run(prompts, params, None, max_num_seqs=4)
    graphed, runner = _run(prompts, params, 3, max_num_seqs=4)
    graphs = runner.graphs
    assert {cols for _, cols in graphs.graphs} == {3, runner.buffers.max_blocks_per_seq}
    assert (1, 3) not in graphs.graphs and (4, 3) in graphs.graphs
    assert 0 < graphs.num_short_replays < graphs.num_replays
    for a, b in zip(eager, graphed):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for la, lb in zip(x.logprobs, y.logprobs):
            assert la.keys() == lb.keys()
            assert np.allclose([la[t] for t in la], [lb[t] for t in la], atol=1e-4)
