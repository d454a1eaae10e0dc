"""compilation_config level 3 on a CUDA GPU: inductor's Triton code between Pagoda's kernels, captured by the decode
CUDA graphs. float32: transformers' greedy tokens, as the eager engine; FP8: the FP8 oracle's tokens; no
compilation after start-up (the capture's warm-up runs and the prefill warm-up compiled every kind of step)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

from pagoda import LLM  # noqa: E402
from tests.engine.test_fp8_parity import oracle  # noqa: E402
from tests.gpu.test_engine_gpu import greedy, hf_tokens  # noqa: E402,F401 - the fixture
from tests.gpu.test_fp8_gpu import greedy_ids  # noqa: E402
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


def test_gpu_compiled_fp8_float32_matches_the_oracle(tiny_checkpoints):
    """FP8 weights and KV, float32 activations: inductor's per-token quantization and Pagoda's FP8 GEMM and e4m3
    attention ops compute the FP8 oracle's definitions (tests/gpu/test_fp8_gpu.py's test, compiled). In bf16 a
    compiled and an eager run differ by one e4m3 rounding here and there, by up to 0.1 in a logprob of the tiny
    random model (the H100, 2026-12-06): no oracle there."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = tiny_checkpoints["llama"]
    llm = LLM(model=model_dir, dtype="float32", device="cuda", quantization="fp8", kv_cache_dtype="fp8",
              num_kv_blocks=512, compilation_config=3)
    try:
        assert isinstance(llm.engine.executor.worker.model.forward, CompiledForward)
        assert greedy_ids(llm, model_dir) == [tokens for tokens, _ in oracle(model_dir)]
    finally:
        llm.shutdown()
