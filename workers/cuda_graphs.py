"""CUDA graphs for decode steps: one graph per padded batch size, replayed instead of launching ~10 kernels per
layer from Python. Prefill and mixed steps stay eager.

Each graph reads the persistent device input tensors of `InputBuffers` (their first `batch` rows) and writes a
static hidden-state output; a batch of B sequences replays the graph of the smallest bucket >= B, with the rows
past B padded (no KV write, a one-token context). The block-table view always has the full width
(max_model_len / block_size columns), so the attention launch shape is fixed at capture time.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from workers.inputs import InputBuffers

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 beyond: padding stays small where steps are fast."""
    sizes = [1, 2, 4] + list(range(8, min(max_num_seqs, 256) + 1, 8)) + list(range(272, max_num_seqs + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, buffers: InputBuffers, max_num_seqs: int):
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.buckets = batch_buckets(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def padded_size(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the largest bucket first so that the smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        cols = self.buffers.max_blocks_per_seq
        for batch in reversed(self.buckets):
            self.buffers.pad_decode(0, batch)
            self.buffers.copy_to_device(batch, batch, cols)
            ids, pos, meta = self.buffers.metadata(batch, batch, 1, cols)
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                self.model(ids, pos, self.kv_caches, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine's other start-up threads (the tokenizer's load, engine/llm_engine.py) go on
            # during the capture; a CUDA call of theirs must not invalidate it, as the default "global" mode lets it.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                hidden = self.model(ids, pos, self.kv_caches, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.graphs), self.max_batch,
                    time.perf_counter() - start)

    def replay(self, num_seqs: int, feed=None) -> torch.Tensor:
        """Runs the decode step whose inputs are already in the host buffers' first num_seqs rows; `feed` then
        writes device-resident input tokens (overlapped steps) before the replay."""
        padded = self.padded_size(num_seqs)
        self.buffers.pad_decode(num_seqs, padded)
        self.buffers.copy_to_device(padded, padded, self.buffers.max_blocks_per_seq)
        if feed is not None:
            feed()
        graph, hidden = self.graphs[padded]
        graph.replay()
        return hidden[:num_seqs]
