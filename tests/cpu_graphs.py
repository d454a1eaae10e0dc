"""A stand-in for CUDA graphs on the CPU (torch.cuda.CUDAGraph cannot run here; tests/gpu has the real ones against
enforce_eager): `CpuGraphRunner` is workers/cuda_graphs.py's runner whose "graphs" rerun the captured call eagerly
over the same input views and write the same static output tensor, so a step through it takes exactly the padded
inputs a real replay reads."""

from __future__ import annotations

from workers.cuda_graphs import CudaGraphRunner


class EagerGraph:
    def __init__(self, run):
        self.run = run
        self.output = run()

    def replay(self):
        self.output.copy_(self.run())


class CpuGraphRunner(CudaGraphRunner):
    def _capture(self, num_tokens, num_seqs, max_query_len):
        ids, pos, meta = self.buffers.metadata(num_tokens, num_seqs, max_query_len, self.buffers.max_blocks_per_seq)
        graph = EagerGraph(lambda: self.model(ids, pos, self.kv_caches, meta))
        return graph, graph.output
