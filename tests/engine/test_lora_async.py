"""Adapters are read off the step loop: a request naming an adapter the workers do not hold yet waits while each
worker reads the file into host memory on a thread of its own; every other request keeps stepping meanwhile; the
request starts once the read is done and then equals transformers + peft. A file found bad by that read fails the
requests of its adapter only.

A read is held back through `workers.lora.before_read`, the test hook that stands for a slow filesystem: the
assertions count steps and tokens, never time."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

import workers.lora
from engine.request import RequestStatus
from engine.request_output import RequestError, RequestOutput
from pagoda import LLM, LoRARequest
from tests.engine.test_lora import MAX_NEW, assert_completion_matches, greedy, lora_llm, oracle, step_until
from tests.lora_adapters import make_adapter
from tests.prompts import PARITY_PROMPTS


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    """Two adapters: one on every projection, one on q and v."""
    root = tmp_path_factory.mktemp("async-adapters")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return (LoRARequest("slow", 1, make_adapter(tiny_model_dir, str(root / "slow"), 16, 32.0, every)),
            LoRARequest("fast", 2, make_adapter(tiny_model_dir, str(root / "fast"), 8, 16.0, ["q_proj", "v_proj"],
                                                seed=1)))


class Requests:
    """Requests added to an engine that the test steps itself, and their outputs as they finish."""

    def __init__(self, engine):
        self.engine = engine
        self.prompts: dict[str, tuple[str | None, list[int]]] = {}
        self.outputs: dict[str, RequestOutput] = {}
        self.errors: dict[str, RequestError] = {}

    def add(self, prompt: str, lora: LoRARequest | None) -> str:
        text, token_ids = self.engine.process_prompt(prompt, greedy())
        req_id = self.engine.add_processed(None, token_ids, greedy(), stream=False, lora_request=lora)
        self.prompts[req_id] = (text, token_ids)
        return req_id

    def step(self) -> None:
        for delta in self.engine.step():
            if delta.error is not None:
                self.errors[delta.request_id] = delta.error
            elif delta.finished:
                self.outputs[delta.request_id] = RequestOutput.from_final_delta(delta, *self.prompts[delta.request_id])

    def run_until(self, condition) -> None:
        step_until(self, condition)

    def num_tokens(self, req_id: str) -> int:
        req = self.engine.scheduler.requests.get(req_id)
        return req.num_output_tokens if req is not None else len(self.outputs[req_id].outputs[0].token_ids)


@pytest.fixture
def held_reads(monkeypatch):
    """Holds back the reads of the adapters whose ids are in the returned set until `release` is set."""
    held: set[int] = set()
    release = threading.Event()

    def before_read(adapter) -> None:
        # (the timeout only ends a test whose engine would wait for this read in its step: the read then fails)
        if adapter.request.id in held and not release.wait(timeout=60):
            raise TimeoutError("the read was held for 60 s")

    monkeypatch.setattr(workers.lora, "before_read", before_read)
    yield held, release
    release.set()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_a_slow_adapter_read_stops_no_other_request(tiny_model_dir, pair, held_reads, overlap):
    slow, fast = pair
    held, release = held_reads
    held.add(slow.id)
    llm = lora_llm(tiny_model_dir, max_loras=2)
    llm.engine.executor.supports_overlap = overlap
    try:
        engine = llm.engine
        reqs = Requests(engine)
        slow_id = reqs.add(PARITY_PROMPTS[0], slow)
        others = [reqs.add(PARITY_PROMPTS[1], None), reqs.add(PARITY_PROMPTS[2], fast)]
        reqs.run_until(lambda: all(i in reqs.outputs for i in others))  # while the slow read is held back
        slow_req = engine.scheduler.requests[slow_id]
        assert slow_req.status == RequestStatus.WAITING and slow_req.num_output_tokens == 0
        assert slow_req.lora_slot == -1 and engine.lora_slots.slot_of(slow.id) is None
        assert engine.lora_slots.num_reading == 1  # its read is still out; fast's finished and fast's request ran
        steps_before = engine.timing.num_steps
        more = reqs.add(PARITY_PROMPTS[3], fast)  # a request that comes while the read is out runs too
        reqs.run_until(lambda: more in reqs.outputs)
        assert engine.scheduler.requests[slow_id].num_output_tokens == 0 and engine.timing.num_steps > steps_before
        engine.check_integrity()
        release.set()
        reqs.run_until(lambda: not engine.has_unfinished_requests())
        assert not reqs.errors
        for req_id, lora in [(slow_id, slow), (others[0], None), (others[1], fast), (more, fast)]:
            assert len(reqs.outputs[req_id].outputs[0].token_ids) == MAX_NEW
            assert_completion_matches(oracle(tiny_model_dir, lora), reqs.outputs[req_id])
        assert engine.lora_slots.host.num_reads == 2  # each adapter read once
        engine.check_integrity()
    finally:
        llm.shutdown()


def test_a_bad_file_found_in_the_background_fails_its_adapter_only(tiny_model_dir, pair, held_reads, tmp_path):
    """Its header passes the check at add_request; the read finds the rest truncated: the requests of that adapter
    fail with the ParamError-style error naming it (a 400 at the edge), the others finish with their own outputs,
    and a request after the file is mended reads it again and runs."""
    slow, fast = pair
    broken = LoRARequest("broken", 7, str(tmp_path / "broken"))
    shutil.copytree(slow.path, broken.path)
    weights = os.path.join(broken.path, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    held, release = held_reads
    held.add(broken.id)
    llm = lora_llm(tiny_model_dir, max_loras=2)
    try:
        engine = llm.engine
        reqs = Requests(engine)
        bad = [reqs.add(PARITY_PROMPTS[0], broken), reqs.add(PARITY_PROMPTS[1], broken)]
        good = [reqs.add(PARITY_PROMPTS[2], fast), reqs.add(PARITY_PROMPTS[3], None)]
        reqs.run_until(lambda: all(reqs.num_tokens(i) >= 2 for i in good))
        assert not reqs.errors  # the read is held: nothing failed yet, and the others run
        release.set()
        reqs.run_until(lambda: not engine.has_unfinished_requests())
        assert set(reqs.errors) == set(bad)
        for req_id in bad:
            error = reqs.errors[req_id]
            assert error.kind == RequestError.INVALID and error.param == "lora_request"
            assert "adapter 'broken' (id 7): failed to load" in error.message
        for req_id, lora in zip(good, [fast, None]):
            assert_completion_matches(oracle(tiny_model_dir, lora), reqs.outputs[req_id])
        engine.check_integrity()
        assert broken.id not in engine.loras and not engine.lora_slots.host.is_ready(broken.id)
        shutil.copy(os.path.join(slow.path, "adapter_model.safetensors"), weights)  # mended: read again
        again = reqs.add(PARITY_PROMPTS[0], broken)
        reqs.run_until(lambda: not engine.has_unfinished_requests())
        assert_completion_matches(oracle(tiny_model_dir, slow), reqs.outputs[again])  # the same weights as slow
        engine.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_slow_read_on_a_gpu_with_cuda_graphs(tiny_model_dir, pair, held_reads):
    """On a GPU (pinned host parts, the slot filled in the step, decode replayed from CUDA graphs): the other
    requests finish while the read is held, and every output equals an engine's whose reads were not held."""
    slow, fast = pair
    held, release = held_reads
    plan = [(PARITY_PROMPTS[0], slow), (PARITY_PROMPTS[1], None), (PARITY_PROMPTS[2], fast)]
    held.add(slow.id)
    with_held_read = _run_on_gpu(tiny_model_dir, plan, release)
    held.clear()
    assert with_held_read == _run_on_gpu(tiny_model_dir, plan, None)


def _run_on_gpu(model_dir: str, plan, release: threading.Event | None) -> list[list[int]]:
    """The greedy tokens of plan's (prompt, adapter) requests; with `release`, the first request's read is held
    until the others have finished."""
    llm = LLM(model=model_dir, dtype="float32", device="cuda", enable_lora=True, max_loras=2)
    try:
        engine = llm.engine
        reqs = Requests(engine)
        ids = [reqs.add(prompt, lora) for prompt, lora in plan]
        reqs.run_until(lambda: all(i in reqs.outputs for i in ids[1:]))
        if release is not None:
            assert engine.scheduler.requests[ids[0]].num_output_tokens == 0
            release.set()
        reqs.run_until(lambda: not engine.has_unfinished_requests())
        engine.check_integrity()
        return [reqs.outputs[i].outputs[0].token_ids for i in ids]
    finally:
        llm.shutdown()
