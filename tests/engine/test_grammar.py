"""The driver's grammar state without a model: random walks through the real matchers on the tiny tokenizer (any
token the bitmask allows, as a model with any weights could pick), the compile cache, the scheduler's wait for a
compilation, the compile queue's fairness, cancellation and timeout, and the integrity check."""

import random
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.grammar import MAX_SLOW_COMPILES, NUM_COMPILE_THREADS, SLOW_COMPILE_S, StructuredOutputManager
from engine.request import Request, RequestStatus
from engine.request_output import RequestError
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.structured_outputs import StructuredOutputsParams, grammar_for
from tests.structured_cases import cases, check_output

EOS = 1


@pytest.fixture
def manager(tiny_tokenizer):
    manager = StructuredOutputManager(tiny_tokenizer, len(tiny_tokenizer), [EOS])
    yield manager
    manager.shutdown()


def start(manager: StructuredOutputManager, case: StructuredOutputsParams, req_id: str = "r", n: int = 1,
          **kwargs) -> list[Request]:
    params = SamplingParams(structured_outputs=case, **kwargs)
    params.all_stop_token_ids = () if params.ignore_eos else (EOS,)
    seqs = [Request(f"{req_id}#{i}", [0], params, 100) for i in range(n)]
    manager.add(seqs)
    manager.wait_for_compile(timeout_s=60)
    assert manager.poll() == []
    return seqs


def start_without_waiting(manager, case, req_id, n: int = 1):
    """Adds a request without waiting for its compilation."""
    params = SamplingParams(structured_outputs=case, n=n)
    params.all_stop_token_ids = (EOS,)
    seqs = [Request(req_id if n == 1 else f"{req_id}#{i}", [0], params, 10) for i in range(n)]
    manager.add(seqs)
    return seqs


def allowed_tokens(manager: StructuredOutputManager, req: Request) -> list[int]:
    bitmask = manager.fill_bitmask([req.req_id], {req.req_id: req}).bitmask
    return np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:manager.vocab_size]).tolist()


def walk(manager, tokenizer, req: Request, rng: random.Random, max_tokens: int = 300) -> str | None:
    """Picks any allowed token until the grammar ends; the text, or None past max_tokens."""
    tokens = []
    for _ in range(max_tokens):
        choices = allowed_tokens(manager, req)
        token = EOS if EOS in choices and rng.random() < 0.3 else rng.choice(choices)
        assert req.grammar.accept(token)
        req.output_token_ids.append(token)
        if token != EOS:
            tokens.append(token)
        if req.grammar.is_finished:
            return tokenizer.decode(tokens)
    return None


@pytest.mark.parametrize("name", list(cases()))
def test_random_walks_through_the_grammar_give_valid_outputs(manager, tiny_tokenizer, name):
    case = cases()[name]
    rng = random.Random(name)
    done = 0
    for i in range(30):
        (req,) = start(manager, case, req_id=f"{name}{i}")
        text = walk(manager, tiny_tokenizer, req, rng)
        if text is not None:
            check_output(case, text)
            done += 1
        req.grammar.release()
    assert done >= 25
    assert manager.stats.num_compiles == 1 and manager.stats.num_cache_hits == 29
    assert not manager.live


def test_json_strings_take_no_raw_control_characters_nor_surrogates(manager):
    """xgrammar 0.2 lets both into some strings; the fixed grammars do not (JSON forbids them)."""
    for schema in ({"type": "string"}, {"type": "string", "maxLength": 4}):
        (req,) = start(manager, StructuredOutputsParams(json=schema))
        matcher = req.grammar.matcher
        assert matcher.accept_string('"a')
        for bad in (b"\x01", b"\xed\xaa\xa4", b"\n"):
            assert not matcher.accept_string(bad), (schema, bad)
        assert matcher.accept_string("é\"")
        req.grammar.release()


def test_the_grammar_ends_a_request_when_nothing_but_a_stop_token_can_follow(manager, tiny_tokenizer):
    for ignore_eos in (False, True):
        (req,) = start(manager, StructuredOutputsParams(choice=["yes", "yes please"]), ignore_eos=ignore_eos)
        for token in tiny_tokenizer.encode("yes", add_special_tokens=False):
            assert req.grammar.accept(token)
        assert not req.grammar.is_finished  # " please" may follow
        assert (EOS in allowed_tokens(manager, req)) != ignore_eos  # with ignore_eos only the grammar ends it
        for token in tiny_tokenizer.encode(" please", add_special_tokens=False):
            assert req.grammar.accept(token)
        assert req.grammar.is_finished
        req.grammar.release()


def test_a_rejected_token_is_an_error_not_a_crash(manager, tiny_tokenizer):
    (req,) = start(manager, StructuredOutputsParams(regex="[0-9]+"))
    assert not req.grammar.accept(tiny_tokenizer.encode("a", add_special_tokens=False)[0])
    assert req.grammar.error.message.startswith("structured_outputs: the grammar rejected token")
    assert req.grammar.error.kind == RequestError.INTERNAL  # the mask should have made it impossible: a 500


def test_compiled_once_per_constraint_least_recently_used_out(tiny_tokenizer):
    manager = StructuredOutputManager(tiny_tokenizer, len(tiny_tokenizer), [EOS], cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    for case in (a, b, a, c, a, b):  # b is out when c comes in (a was used after it), and compiles again
        start(manager, case, req_id=case.regex)
    assert manager.stats.num_compiles == 4 and manager.stats.num_cache_hits == 2
    assert manager.stats.max_compile_s > 0
    manager.shutdown()


def test_n_sequences_get_their_own_matchers(manager, tiny_tokenizer):
    first, second = start(manager, StructuredOutputsParams(regex="(ab|cd)+"), n=2)
    assert first.grammar.matcher is not second.grammar.matcher
    for token in tiny_tokenizer.encode("ab", add_special_tokens=False):
        assert first.grammar.accept(token)
    assert allowed_tokens(manager, first) != allowed_tokens(manager, second)


def test_the_scheduler_admits_a_request_once_its_grammar_compiled(manager, tiny_tokenizer):
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(16, 4, True))
    compiling = Future()  # a real future, resolved by hand: this compilation takes as long as the test wants
    manager._cache[StructuredOutputsParams(regex="x+").key] = compiling
    (waiting,) = start_without_waiting(manager, StructuredOutputsParams(regex="x+"), "waiting")
    plain = Request("plain", [0, 1, 2], SamplingParams(), 10)
    scheduler.add_request(waiting)
    scheduler.add_request(plain)
    assert list(scheduler.schedule().num_scheduled_tokens) == ["plain"]
    assert manager.is_compiling and manager.poll() == []
    compiling.set_result(manager._get_compiler().compile_grammar(grammar_for(StructuredOutputsParams(regex="x+"))))
    assert manager.poll() == [] and waiting.grammar.is_ready
    assert "waiting" in scheduler.schedule().num_scheduled_tokens
    manager.check_integrity(scheduler.requests)
    scheduler.finish_request("waiting", RequestStatus.FINISHED_ABORTED)
    assert "waiting" not in manager.live


def test_integrity_check_finds_a_leaked_matcher(manager):
    (req,) = start(manager, StructuredOutputsParams(regex="a+"))
    manager.check_integrity({req.req_id: req})
    with pytest.raises(AssertionError, match="grammars leaked"):
        manager.check_integrity({})  # the request is gone but its matcher was never released
    req.output_token_ids.append(5)
    with pytest.raises(AssertionError, match="accepted 0 of 1 tokens"):
        manager.check_integrity({req.req_id: req})


class Clock:
    """Time the test moves by hand: which compilation counts as slow, and which request waited too long, is then
    decided by the test, not by how fast this machine is."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def gate():
    """Stand-ins for compilations that take minutes (two 40,000-value enums once held the compile pool for a
    minute): jobs on the manager's real queue that run until the test opens the gate."""
    event = threading.Event()
    yield event
    event.set()


def hold(manager, gate, count: int) -> list[Future]:
    return [manager.compiles.submit(gate.wait) for _ in range(count)]


def test_a_long_compilation_does_not_hold_back_the_small_ones(tiny_tokenizer, gate):
    clock = Clock()
    manager = StructuredOutputManager(tiny_tokenizer, len(tiny_tokenizer), [EOS], clock=clock)
    long = hold(manager, gate, NUM_COMPILE_THREADS)
    (queued,) = start_without_waiting(manager, StructuredOutputsParams(regex="q+"), "queued")
    assert manager.compiles.num_running == NUM_COMPILE_THREADS and manager.compiles.num_pending == 1
    assert manager.poll() == [] and not queued.grammar.compiled.running()  # the long ones hold every thread
    clock.now += SLOW_COMPILE_S  # they have run long: they no longer count against the threads
    manager.poll()
    manager.wait_for_compile(timeout_s=60)
    assert manager.poll() == [] and queued.grammar.is_ready
    (small,) = start(manager, StructuredOutputsParams(regex="s+"), req_id="small")
    assert small.grammar.is_ready and not any(f.done() for f in long)
    manager.shutdown()


def test_slow_compilations_take_at_most_their_own_threads_and_a_queued_one_leaves_with_its_request(
        tiny_tokenizer, gate):
    clock = Clock()
    manager = StructuredOutputManager(tiny_tokenizer, len(tiny_tokenizer), [EOS], clock=clock)
    hold(manager, gate, NUM_COMPILE_THREADS)
    clock.now += SLOW_COMPILE_S
    manager.compiles.dispatch()
    hold(manager, gate, MAX_SLOW_COMPILES)  # these start: the first are slow
    clock.now += SLOW_COMPILE_S  # all slow now: MAX_SLOW_COMPILES of them leave their threads, the others hold
    case = StructuredOutputsParams(regex="(ab)+")
    (first, second) = start_without_waiting(manager, case, "both", n=2)
    assert manager.poll() == [] and manager.compiles.num_pending == 1
    assert manager.compiles.num_running == NUM_COMPILE_THREADS + MAX_SLOW_COMPILES
    first.grammar.release()  # one sequence gone: the other still waits for it
    assert not first.grammar.compiled.cancelled() and manager._cache[case.key] is second.grammar.compiled
    second.grammar.release()  # the request is gone (aborted): its compilation never runs
    assert second.grammar.compiled.cancelled() and case.key not in manager._cache
    assert manager.compiles.num_pending == 0 and manager.stats.num_compiles_cancelled == 1
    gate.set()
    (again,) = start(manager, case, req_id="again")  # compiled afresh, not the cancelled one
    assert again.grammar.is_ready and manager.stats.num_compiles == 1
    manager.shutdown()


def test_a_grammar_not_compiled_within_the_timeout_fails_its_request(tiny_tokenizer, gate):
    clock = Clock()
    manager = StructuredOutputManager(tiny_tokenizer, len(tiny_tokenizer), [EOS], compile_timeout_s=30,
                                      clock=clock)
    hold(manager, gate, NUM_COMPILE_THREADS)
    clock.now += SLOW_COMPILE_S
    manager.compiles.dispatch()
    hold(manager, gate, MAX_SLOW_COMPILES)
    (late,) = start_without_waiting(manager, StructuredOutputsParams(regex="l+"), "late")
    clock.now += 29
    assert manager.poll() == []
    clock.now += 2
    assert manager.poll() == [late.grammar]
    assert late.grammar.error == RequestError("structured_outputs: the grammar did not compile within 30 s "
                                              "(PAGODA_GRAMMAR_COMPILE_TIMEOUT_S); retry shortly",
                                              RequestError.UNAVAILABLE)  # a 503: the compilation goes on
    late.grammar.release()  # as the engine fails the request
    assert late.grammar.compiled.cancelled() and manager.stats.num_compile_timeouts == 1
    assert not manager.is_compiling and not manager.live
    manager.shutdown()


def test_prepared_in_background_the_first_compile_reads_no_tokenizer(tiny_tokenizer):
    """The engine prepares xgrammar and the tokenizer's vocabulary before any constrained request (on a GPU
    engine): the first compile then finds the compiler ready."""
    manager = StructuredOutputManager(tiny_tokenizer, 1000, {tiny_tokenizer.eos_token_id})
    assert manager._compiler is None
    manager.prepare_in_background().join(timeout=300)
    compiler = manager._compiler
    assert compiler is not None and manager.stats.tokenizer_info_s > 0
    assert manager.stats.num_compiles == 0 and not manager._cache  # its warm-up grammar is no request's
    req = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+")), 8)
    manager.add([req])
    manager.wait_for_compile(timeout_s=300)
    assert manager.poll() == [] and req.grammar.is_ready
    assert manager._compiler is compiler and manager.stats.num_compiles == 1
    req.grammar.release()
    manager.shutdown()
