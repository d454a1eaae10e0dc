"""Speculative verify steps under CUDA graphs (workers/cuda_graphs.py) against the same steps run eagerly: same
greedy tokens and logprobs, with mixed draft counts (0..k) and batches padded to their bucket, in float32, with an
FP8 KV cache and with LoRA adapters beside base rows."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagoda import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.lora_adapters import make_adapter  # noqa: E402
from tests.spec_proposers import OracleLookup, OracleProposer  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. A language model reads a prompt",
           "def fibonacci(n: int) -> list[int]:", "Once upon a time there was a small model that wanted to learn.",
           "1 2 3", "What is the capital of France? Paris is the capital."]
# different lengths: the batch shrinks through buckets 8, 4, 2, 1 (6 and 3 rows: padding rows)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (40, 33, 26, 19, 12, 47)]


def _generate(model_dir, eager: bool, references=None, lora=None, on_device=False, params=PARAMS, **kwargs):
    """(outputs, verify graph replays); speculative with the oracle proposer when references are given (it knows
    all but the last prompt's continuation: that row never has drafts; every 2nd proposal's last draft is wrong).
    on_device: the oracle in the runner's device lookup's place, so steps run ahead of the verify step in flight
    (its drafts read back to the host there: a test double, whose waits cost time, not correctness)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(model=model_dir, device="cuda", block_size=16, num_kv_blocks=512, enforce_eager=eager,
              speculative_config=NGRAM if references is not None else None, **kwargs)
    if references is not None and on_device:
        llm.engine.executor.worker.runner.lookup = OracleLookup(references[:-1], NGRAM["num_speculative_tokens"],
                                                                wrong_every=2)
    elif references is not None:
        llm.engine.spec.proposer = OracleProposer(references[:-1], NGRAM["num_speculative_tokens"], wrong_every=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    if on_device:
        assert llm.engine.spec.num_steps_ahead > 0
    graphs = llm.engine.executor.worker.runner.graphs
    llm.engine.check_integrity()
    llm.shutdown()
    return outs, 0 if graphs is None else graphs.num_verify_replays


def _assert_same(a_outs, b_outs, atol):
    for a, b in zip(a_outs, b_outs):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for la, lb in zip(x.logprobs, y.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t] == pytest.approx(lb[t], abs=atol)


def _check(model_dir, atol, lora=None, against_plain=True, **kwargs):
    plain, _ = _generate(model_dir, eager=True, lora=lora, **kwargs)
    references = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in plain]
    eager, eager_replays = _generate(model_dir, eager=True, references=references, lora=lora, **kwargs)
    graphed, replays = _generate(model_dir, eager=False, references=references, lora=lora, **kwargs)
    assert eager_replays == 0 and replays > 0
    _assert_same(eager, graphed, atol)
    if against_plain:  # (FP8 KV: a key computed in a verify step may round to another e4m3 value than one by one)
        _assert_same(plain, graphed, atol)


@pytest.mark.parametrize("kwargs, atol", [
    ({"dtype": "float32"}, 1e-4),
    ({"dtype": "float32", "max_num_seqs": 3}, 1e-4),  # buckets 1, 2, 3: the largest has no padding row
    ({"dtype": "float32", "kv_cache_dtype": "fp8", "against_plain": False}, 1e-2),
], ids=["f32", "f32-3-seqs", "fp8-kv"])
def test_gpu_verify_graphs_match_eager(tiny_checkpoints, kwargs, atol):
    _check(tiny_checkpoints["llama"], atol, **kwargs)


def test_gpu_verify_graphs_with_lora_beside_base_rows(tiny_checkpoints, tmp_path):
    model_dir = tiny_checkpoints["llama"]
    adapter = LoRARequest("a", 1, make_adapter(model_dir, str(tmp_path / "a"), 8, 16.0,
                                               ["q_proj", "v_proj", "down_proj"]))
    _check(model_dir, 1e-4, lora=[adapter, None] * 3, dtype="float32", enable_lora=True)



def test_gpu_verify_graphs_run_ahead_with_device_drafts(tiny_checkpoints):
    """Device drafts: each verify step is launched before the one in flight is read back, and its fix-ups (the fed
    token, the drafts, positions, KV slots and sequence lengths moved back by the rejected drafts) are written into
    the graph's static inputs before the replay: the plain engine's tokens and logprobs, graphed and eager."""
    model_dir = tiny_checkpoints["llama"]
    plain, _ = _generate(model_dir, eager=True, dtype="float32")
    references = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in plain]
    eager, eager_replays = _generate(model_dir, eager=True, references=references, on_device=True, dtype="float32")
    graphed, replays = _generate(model_dir, eager=False, references=references, on_device=True, dtype="float32")
    assert eager_replays == 0 and replays > 0
    _assert_same(plain, eager, 1e-4)
    _assert_same(plain, graphed, 1e-4)


def test_gpu_constrained_rows_run_ahead_with_device_drafts(tiny_checkpoints):
    """Rows with a grammar in verify steps launched ahead: each such step defers its verification until the driver
    has read the step before and sent the bitmask for the drafts the device proposed (a copy started behind the
    lookup, before the graph's replay): the plain engine's tokens and logprobs, graphed and eager."""
    from engine.structured_outputs import StructuredOutputsParams

    regex = StructuredOutputsParams(regex="[a-z ,.]{1,300}")
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True, logprobs=2,
                             structured_outputs=regex if i % 2 else None) for i, p in enumerate(PARAMS)]
    model_dir = tiny_checkpoints["llama"]
    plain, _ = _generate(model_dir, eager=True, dtype="float32", params=params)
    references = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in plain]
    eager, eager_replays = _generate(model_dir, eager=True, references=references, on_device=True, dtype="float32",
                                     params=params)
    graphed, replays = _generate(model_dir, eager=False, references=references, on_device=True, dtype="float32",
                                 params=params)
    assert eager_replays == 0 and replays > 0
    _assert_same(plain, eager, 1e-4)
    _assert_same(plain, graphed, 1e-4)


def test_gpu_run_ahead_default_by_the_measured_decode_step(tiny_checkpoints, monkeypatch):
    """PAGODA_SPEC_RUN_AHEAD's default (`device`): the executor times a batch-1 decode graph at start-up (a tiny
    model's: well under RUN_AHEAD_MIN_DEVICE_STEP_S, so pipelined; a threshold under it: ahead), and the engine's
    speculative decoder is pinned to that way; eagerly there is nothing timed (pipelined)."""
    from engine.spec_decode import RUN_AHEAD_MIN_DEVICE_STEP_S

    monkeypatch.setenv("PAGODA_SPEC_RUN_AHEAD", "device")
    steps = {}
    for eager in (False, True):
        llm = LLM(model=tiny_checkpoints["llama"], device="cuda", block_size=16, num_kv_blocks=512,
                  enforce_eager=eager, speculative_config=NGRAM)
        steps[eager] = step_s = llm.engine.executor.decode_step_s
        assert (step_s is None) is eager
        assert eager or 0.0 < step_s < RUN_AHEAD_MIN_DEVICE_STEP_S
        assert llm.engine.spec.run_ahead.pinned is False and not llm.engine.spec.can_run_ahead
        llm.shutdown()
    monkeypatch.setattr("engine.spec_decode.RUN_AHEAD_MIN_DEVICE_STEP_S", steps[False] / 10)
    llm = LLM(model=tiny_checkpoints["llama"], device="cuda", block_size=16, num_kv_blocks=512,
              speculative_config=NGRAM)
    assert llm.engine.spec.run_ahead.pinned is True and llm.engine.spec.can_run_ahead
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, PARAMS))
    llm.engine.check_integrity()
    llm.shutdown()
