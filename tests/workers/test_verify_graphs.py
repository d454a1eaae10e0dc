"""Verify graphs (workers/cuda_graphs.py) without a GPU: which buckets get one, how `InputBuffers.pad_verify` lays a
step out, and the engine's speculative steps through the same padded inputs, with a stand-in that replays each
"graph" as an eager call over the captured views (torch.cuda.CUDAGraph cannot run here; tests/gpu has the real
ones against enforce_eager)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import SamplingParams
from tests.cpu_graphs import CpuGraphRunner
from tests.spec_proposers import OracleProposer
from workers.cuda_graphs import MAX_VERIFY_BATCH, batch_buckets, verify_buckets
from workers.inputs import InputBuffers


def test_verify_buckets_fit_the_buffers_and_the_context():
    buckets = batch_buckets(256)
    assert verify_buckets(buckets, 0, 10_000, 10_000) == []
    assert verify_buckets(buckets, 4, 10_000, 10_000) == [b for b in buckets if b <= MAX_VERIFY_BATCH]
    assert verify_buckets(buckets, 4, 8192 + 256, 100) == [1, 2, 4, 8, 16]  # 16 * 5 = 80 <= 100 < 24 * 5
    assert verify_buckets(buckets, 3, 64, 4096) == [1, 2, 4, 8, 16]  # 16 * 4 tokens fill 64 slots
    assert verify_buckets(batch_buckets(6), 4, 10_000, 10_000) == [1, 2, 4, 6]


def test_pad_verify_puts_the_leftover_slots_in_one_last_row_that_writes_no_kv():
    buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=8, block_size=4,
                           device=torch.device("cpu"), has_lora=True)
    # three decodes: 0, 2 and 4 drafts (1, 3 and 5 tokens), in a bucket of 4 sequences, k = 4: 20 slots
    tokens = [list(range(10)), list(range(20, 27)) + [90, 91], list(range(30, 35)) + [92, 93, 94, 95]]
    starts, counts = [9, 6, 4], [1, 3, 5]
    blocks = [[7, 2, 5], [1, 3, 8], [6, 4, 0]]
    num_tokens, _ = buffers.fill(tokens, starts, counts, blocks, lora_slots=[-1, 1, 0])
    assert num_tokens == 9
    buffers.pad_verify(3, num_tokens, 4, 20)
    n = buffers.np
    assert n["query_start_loc"][:6].tolist() == [0, 1, 4, 9, 9, 20]  # row 3: no token; row 4: the 11 left over
    assert n["seq_lens"][:5].tolist() == [10, 9, 9, 1, 11]
    assert n["input_ids"][:9].tolist() == [9, 26, 90, 91, 34, 92, 93, 94, 95]
    assert n["positions"][:9].tolist() == [9, 6, 7, 8, 4, 5, 6, 7, 8]
    assert n["slot_mapping"][:9].tolist() == [5 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 8 * 4 + 0, 4 * 4 + 0, 4 * 4 + 1,
                                              4 * 4 + 2, 4 * 4 + 3, 0 * 4 + 0]
    assert n["lora_slots"][:20].tolist() == [-1, 1, 1, 1, 0, 0, 0, 0, 0] + [-1] * 11
    assert (n["slot_mapping"][9:20] == -1).all() and (n["positions"][9:20] == 0).all()
    assert (n["input_ids"][9:20] == 0).all()
    assert n["block_tables"][3, 0] == 0 and (n["block_tables"][4, :3] == 0).all()  # 11 tokens: 3 blocks of 4
    # a full bucket: no slot left over, the last row is empty
    buffers.fill([t[:s + c] for t, s, c in zip(tokens, starts, [1, 1, 1])], starts, [1, 1, 1], blocks, [-1] * 3)
    buffers.pad_verify(3, 3, 3, 3)
    assert buffers.np["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 3]
    assert buffers.np["seq_lens"][3] == 1
    with pytest.raises(AssertionError, match="do not fit"):
        buffers.pad_verify(3, 9, 2, 10)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [1, 2, 3, 4] * 5, [11, 12, 13], list(range(20, 61))]


def _generate(prompts, params, graphs: bool, references=None, lora=None, **kwargs):
    from pagoda import LLM

    llm = LLM(**({"model": "tiny", "device": "cpu", "num_kv_blocks": 96, "block_size": 4} | kwargs))
    runner = llm.engine.executor.worker.runner
    if graphs:
        k = NGRAM["num_speculative_tokens"] if "speculative_config" in kwargs else 0
        runner.graphs = CpuGraphRunner(runner.model, runner.kv_caches, runner.buffers,
                                        llm.engine.config.scheduler.max_num_seqs, k)
        runner.graphs.capture()
    if references is not None:
        llm.engine.spec.proposer = OracleProposer(references, 4, wrong_every=2)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    llm.engine.check_integrity()
    llm.shutdown()
    return outs, runner


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    from pagoda import LoRARequest
    from tests.lora_adapters import make_adapter

    path = make_adapter(tiny_model_dir, str(tmp_path_factory.mktemp("adapter") / "a"), 8, 16.0,
                        ["q_proj", "v_proj", "down_proj"])
    return LoRARequest("a", 1, path)


@pytest.mark.parametrize("max_num_seqs, with_lora", [(4, False), (3, False), (4, True)],
                         ids=["buckets-1-2-4", "buckets-1-2-3", "lora"])
def test_verify_steps_through_the_padded_graph_inputs_give_the_plain_output(max_num_seqs, with_lora, request):
    """Mixed draft counts (the oracle proposes 0..4, every second proposal's last draft wrong; the fourth prompt is
    never proposed for) and batches that do not fill their bucket: tokens and logprobs equal the plain run's. With
    LoRA: an adapter on two rows, the base model on the others (the padding tokens' slot is -1)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (21, 24, 15, 18)]
    extra = {"max_num_seqs": max_num_seqs}
    lora = None
    if with_lora:
        a = request.getfixturevalue("adapter")
        lora, extra = [a, None, None, a], extra | {"enable_lora": True, "dtype": "float32"}
    plain, _ = _generate(PROMPTS, params, graphs=False, lora=lora, **extra)
    references = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in plain][:3]
    spec, runner = _generate(PROMPTS, params, graphs=True, references=references, lora=lora,
                             speculative_config=NGRAM, **extra)
    assert runner.graphs.num_verify_replays > 0
    for a, b in zip(plain, spec):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for la, lb in zip(x.logprobs, y.logprobs):
            assert la.keys() == lb.keys()
            assert np.allclose([la[t] for t in la], [lb[t] for t in la], atol=1e-4)
