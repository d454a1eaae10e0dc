"""compilation_config level 3 on a CUDA GPU: inductor's Triton code between Pagoda's kernels, captured by the decode
CUDA graphs. float32: transformers' greedy tokens, as the eager engine; FP8: the eager engine's tokens; no
compilation after start-up (the capture's warm-up runs and the prefill warm-up compiled every kind of step)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

from pagoda import LLM  # noqa: E402
from tests.gpu.test_engine_gpu import greedy, hf_tokens  # noqa: E402,F401 - the fixture
from workers.compile import CompiledForward  # noqa: E402


def test_gpu_compiled_greedy_parity_with_transformers(tiny_checkpoints, hf_tokens):  # noqa: F811
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(model=tiny_checkpoints["llama"], dtype="float32", device="cuda", block_size=16, num_kv_blocks=512,
              compilation_config=3)
    try:
        worker = llm.engine.executor.worker
        assert isinstance(worker.model.forward, CompiledForward)
        assert worker.runner.graphs is not None
        compiled = counters["stats"]["unique_graphs"]
        outs = greedy(llm)
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
        assert worker.runner.graphs.num_replays > 0  # decode steps replayed the captured compiled code
        assert counters["stats"]["unique_graphs"] == compiled, "a step compiled after start-up"
        llm.engine.check_integrity()
    finally:
        llm.shutdown()


def test_gpu_compiled_fp8_matches_eager(tiny_checkpoints):
    kwargs = dict(model=tiny_checkpoints["llama"], dtype="bfloat16", device="cuda", num_kv_blocks=512,
                  quantization="fp8", kv_cache_dtype="fp8")
    eager = LLM(**kwargs)
    ref = greedy(eager, 12)
    eager.shutdown()
    llm = LLM(**kwargs, compilation_config=3)
    try:
        got = greedy(llm, 12)
        for a, b in zip(ref, got):
            first_a, first_b = a.outputs[0], b.outputs[0]
            assert first_a.token_ids[0] == first_b.token_ids[0]
            lp_a = first_a.logprobs[0][first_a.token_ids[0]]
            lp_b = first_b.logprobs[0][first_b.token_ids[0]]
            assert abs(lp_a - lp_b) < 0.05
        llm.engine.check_integrity()
    finally:
        llm.shutdown()
