"""The engine's start-up: the tokenizer loads on a thread of its own while the executor loads the model
(engine/llm_engine.py, engine/startup.py), its phase is recorded as overlapped, and a tokenizer that fails to load
fails the engine's construction with the load's own error.

The overlap is shown by ordering, never by timing: each side waits, inside its own start, for the other to have
begun, which only concurrent starts can both get past (the waits' timeouts guard a hang; they measure nothing).
The waits wrap the real load and the real executor, which then run as they always do."""

import threading

import pytest

import engine.llm_engine
import engine.tokenizer
from cluster.executors import pick_executor
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.prompts import longest_token_chars
from engine.sampling_params import SamplingParams
from engine.startup import BackgroundPhase, Overlap, StartupTimes
from workers.worker import InProcessExecutor

HANG_GUARD_S = 120.0


def _config(model_dir, **kwargs):
    return EngineArgs(model=model_dir, device="cpu", num_kv_blocks=32, **kwargs).create_engine_config()


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(HANG_GUARD_S):
        raise AssertionError(f"{what} never began: the two did not run at the same time")


def test_the_tokenizer_loads_while_the_executor_starts(tiny_model_dir, tiny_tokenizer, monkeypatch):
    tokenizer_began, executor_began = threading.Event(), threading.Event()
    threads = {}
    real_load, real_start = engine.tokenizer.load_tokenizer, InProcessExecutor.__init__

    def load(*args, **kwargs):
        threads["tokenizer"] = threading.current_thread()
        tokenizer_began.set()
        _wait(executor_began, "the executor's start")
        return real_load(*args, **kwargs)

    def start(self, config):
        threads["executor"] = threading.current_thread()
        executor_began.set()
        _wait(tokenizer_began, "the tokenizer's load")
        real_start(self, config)

    monkeypatch.setattr(engine.llm_engine, "load_tokenizer", load)  # where the engine reads it
    monkeypatch.setattr(InProcessExecutor, "__init__", start)
    llm = LLMEngine(_config(tiny_model_dir), pick_executor)
    try:
        assert threads["executor"] is threading.current_thread() and threads["tokenizer"] is not threads["executor"]
        startup = llm.startup
        # the critical path: imports first (torch before the tokenizer's thread imports transformers), the executor's
        # phases, then the wait for the tokenizer; the load itself is beside them, not among them
        phases = list(startup.phases)
        assert phases[0] == "imports" and {"weights", "kv_alloc", "tokenizer_wait"} <= set(phases), phases
        assert phases.index("tokenizer_wait") > phases.index("kv_alloc") and "tokenizer" not in phases
        assert set(startup.overlapped) == {"tokenizer"} and startup.overlapped["tokenizer"].wall_s > 0
        assert "beside them: tokenizer" in startup.describe()
        # what the engine built from the tokenizer it got from that thread
        assert llm.limits.max_chars_per_token == longest_token_chars(tiny_tokenizer)
        assert tiny_tokenizer.eos_token_id in llm.eos_token_ids
        llm.add_request("r", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        stream=False)
        deltas = []
        while llm.has_unfinished_requests():
            deltas += llm.step()
        (seq,) = deltas[-1].seqs
        assert len(seq.token_ids) == 6 and seq.text == tiny_tokenizer.decode(seq.token_ids)
    finally:
        llm.shutdown()


def test_a_tokenizer_that_fails_to_load_fails_the_engine_with_its_error(tiny_model_dir, tmp_path, monkeypatch):
    """As when it loaded inline: the load's own exception, naming the path; the executor built meanwhile is shut
    down, not leaked."""
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"tokenizer '{empty}' could not be loaded") as inline:
        engine.tokenizer.load_tokenizer(str(empty))
    shut_down = []
    real_shutdown = InProcessExecutor.shutdown

    def shutdown(self):
        shut_down.append(self)
        real_shutdown(self)

    monkeypatch.setattr(InProcessExecutor, "shutdown", shutdown)
    with pytest.raises(ValueError) as raised:
        LLMEngine(_config(tiny_model_dir, tokenizer=str(empty)), pick_executor)
    assert str(raised.value) == str(inline.value)
    assert len(shut_down) == 1 and shut_down[0].worker is None


def test_startup_times_keep_the_critical_path_and_what_ran_beside_it():
    startup = StartupTimes({"imports": 1.0})
    other = StartupTimes({"weights": 2.0, "imports": 0.5}, overlapped={"tokenizer": Overlap(3.0, 2.5)})
    startup.merge(other)
    assert startup.phases == {"imports": 1.5, "weights": 2.0} and startup.total_s() == 3.5
    assert startup.overlapped == {"tokenizer": Overlap(3.0, 2.5)}
    assert startup.describe() == "imports 1.5 s, weights 2.0 s; beside them: tokenizer 3.0 s (2.5 s CPU)"


def test_a_background_phase_joins_with_its_result_or_its_error():
    release = threading.Event()
    phase = BackgroundPhase("work", lambda: (release.wait(HANG_GUARD_S), 42)[1])
    startup = StartupTimes()
    assert not startup.overlapped  # nothing recorded before the join
    release.set()
    assert phase.join(startup) == 42
    assert "work_wait" in startup.phases and startup.overlapped["work"].wall_s >= 0

    def fail():
        raise ValueError("tokenizer: bad file")

    with pytest.raises(ValueError, match="tokenizer: bad file"):
        BackgroundPhase("broken", fail).join(startup)
    assert "broken" in startup.overlapped and "broken_wait" in startup.phases
