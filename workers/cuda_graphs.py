"""CUDA graphs for decode and speculative verify steps: one graph per padded batch size, replayed instead of
launching ~10 kernels per layer from Python. Prefill and mixed steps stay eager.

Each graph reads the persistent device input tensors of `InputBuffers` (their first rows) and writes a static
hidden-state output. The block-table view always has the full width (max_model_len / block_size columns), so the
attention launch shape is fixed at capture time.

    decode graph B      B sequences, B tokens; a batch of n <= B replays it with rows n..B padded (no KV write, a
                        one-token context): the decode attention kernel
    verify graph B      (speculative engines, num_speculative_tokens k) B + 1 sequences, B * (k + 1) token slots: a
                        step of n <= B decodes, each its last token and 0..k drafts, fills the first slots in order
                        and `InputBuffers.pad_verify` gives the rest to the last row (no KV write). The packed-prefill
                        attention kernel reads each row's query length from query_start_loc on the device; its
                        grid depends only on the token and sequence counts (kernels/paged_attention.py)
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time

import torch

from workers.inputs import InputBuffers

logger = logging.getLogger(__name__)

MAX_VERIFY_BATCH = 64  # verify graphs up to this batch: speculation pays at small batches, graphs cost memory


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 beyond: padding stays small where steps are fast."""
    sizes = [1, 2, 4] + list(range(8, min(max_num_seqs, 256) + 1, 8)) + list(range(272, max_num_seqs + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
    return sizes


def verify_buckets(buckets: list[int], spec_tokens: int, max_tokens: int, max_context: int) -> list[int]:
    """The decode buckets that get a verify graph: up to MAX_VERIFY_BATCH sequences, whose B * (k + 1) token
    slots fit the input buffers (max_tokens) and one padding row's context (max_context = max_model_len)."""
    if spec_tokens <= 0:
        return []
    return [b for b in buckets if b <= MAX_VERIFY_BATCH and b * (spec_tokens + 1) <= min(max_tokens, max_context)]


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, buffers: InputBuffers, max_num_seqs: int,
                 spec_tokens: int = 0):
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.buckets = batch_buckets(max_num_seqs)
        self.spec_tokens = spec_tokens  # k: a verify step scores up to 1 + k tokens a sequence
        max_tokens = buffers.dev["input_ids"].shape[0]
        self.verify_buckets = verify_buckets(self.buckets, spec_tokens, max_tokens,
                                             buffers.max_blocks_per_seq * buffers.block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0  # decode steps run by a graph (tests and benchmarks read both)
        self.num_verify_replays = 0  # verify steps run by a graph
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def padded_size(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def can_verify(self, num_seqs: int, max_query_len: int) -> bool:
        """Whether a verify step of num_seqs decodes, none of more than max_query_len tokens, fits a verify graph."""
        return (bool(self.verify_buckets) and num_seqs <= self.verify_buckets[-1]
                and max_query_len <= self.spec_tokens + 1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the largest graphs first so that the smaller ones reuse their memory pool (one pool for both
        families: a step replays one graph, and each graph's output stays referenced)."""
        start = time.perf_counter()
        cols = self.buffers.max_blocks_per_seq
        for batch in reversed(self.verify_buckets):
            num_tokens = batch * (self.spec_tokens + 1)
            self.buffers.pad_verify(0, 0, batch, num_tokens)
            self.buffers.copy_to_device(num_tokens, batch + 1, cols)
            self.verify_graphs[batch] = self._capture(num_tokens, batch + 1, self.spec_tokens + 1)
        for batch in reversed(self.buckets):
            self.buffers.pad_decode(0, batch)
            self.buffers.copy_to_device(batch, batch, cols)
            self.graphs[batch] = self._capture(batch, batch, 1)
        logger.info("captured %d decode CUDA graphs (batch 1..%d) and %d verify graphs (%d tokens a sequence) in "
                    "%.1f s", len(self.graphs), self.max_batch, len(self.verify_graphs), self.spec_tokens + 1,
                    time.perf_counter() - start)

    def _capture(self, num_tokens: int, num_seqs: int, max_query_len: int,
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos, meta = self.buffers.metadata(num_tokens, num_seqs, max_query_len, self.buffers.max_blocks_per_seq)
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
        torch.cuda.synchronize()
        return graph, hidden

    @torch.inference_mode()
    def time_decode(self, replays: int = 10) -> float:
        """Seconds a decode step of one sequence takes on the device: the median of `replays` replays of the smallest
        decode graph, each alone (CUDA events), its rows padding (as a padded step's extra rows: nothing real is
        read or written). What n-gram speculation's default way of launching verify steps goes by
        (engine/spec_decode.py RUN_AHEAD_MIN_DEVICE_STEP_S)."""
        batch = self.buckets[0]
        self.buffers.pad_decode(0, batch)
        self.buffers.copy_to_device(batch, batch, self.buffers.max_blocks_per_seq)
        graph, _ = self.graphs[batch]
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

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
        self.num_replays += 1
        return hidden[:num_seqs]

    def replay_verify(self, num_seqs: int, num_tokens: int, feed=None) -> torch.Tensor:
        """Runs the verify step of num_seqs decodes (num_tokens tokens, at most 1 + k each) whose inputs are in
        the host buffers; returns the hidden states of its num_tokens real tokens."""
        padded = self.verify_buckets[bisect.bisect_left(self.verify_buckets, num_seqs)]
        padded_tokens = padded * (self.spec_tokens + 1)
        self.buffers.pad_verify(num_seqs, num_tokens, padded, padded_tokens)
        self.buffers.copy_to_device(padded_tokens, padded + 1, self.buffers.max_blocks_per_seq)
        if feed is not None:
            feed()
        graph, hidden = self.verify_graphs[padded]
        graph.replay()
        self.num_verify_replays += 1
        return hidden[:num_tokens]
