"""A stand-in for CUDA graphs on the CPU (torch.cuda.CUDAGraph cannot run here; tests/gpu has the real ones against
enforce_eager): `CpuGraphRunner` is workers/cuda_graphs.py's runner whose "graphs" rerun the captured calls eagerly
over the same input views and write the same static output tensors, stage by stage (each layer range reads the
static (h, residual) the range before wrote), so a step through it takes exactly the padded inputs a real replay
reads."""

from __future__ import annotations

from workers.cuda_graphs import CudaGraphRunner, StagedGraph


class EagerGraph:
    def __init__(self, run):
        self.run = run
        self.output = run()

    def replay(self):
        out = self.run()
        for static, new in zip(_tensors(self.output), _tensors(out)):
            static.copy_(new)


def _tensors(output):
    return output if isinstance(output, tuple) else (output,)


class CpuGraphRunner(CudaGraphRunner):
    def _capture(self, num_tokens, num_seqs, max_query_len):
        ids, pos, meta = self.buffers.metadata(num_tokens, num_seqs, max_query_len, self.buffers.max_blocks_per_seq)
        stages, carry = [], None
        for start, end in self.stage_bounds:
            stage = EagerGraph(lambda start=start, end=end, carry=carry: self.model.forward_layers(
                start, end, ids, pos, self.kv_caches, meta, carry))
            stages.append(stage)
            carry = stage.output
        return StagedGraph(stages), carry
