"""Structured outputs on the driver: grammars compiled against the model's tokenizer (off the step thread, LRU
cache), one xgrammar matcher per sequence, and each step's packed bitmask of allowed tokens.

    add_request ─► StructuredOutputManager.add(seqs)  compile on the CompileQueue (a cached grammar: nothing to do)
    each step   ─► poll()                              compiled: a matcher per sequence, the scheduler admits it
                                                       failed, or not compiled within the compile timeout: that
                                                       request fails alone (RequestError INVALID: the compiler
                                                       refused it; UNAVAILABLE: the timeout)
                ─► fill_bitmask(req_ids)               int32 [rows, ceil(tokenizer vocab / 32)], a row each
    update_from_output ─► RequestGrammar.accept(token)
    finish, abort      ─► RequestGrammar.release()     (check_integrity: no matcher outlives its request)

The grammars cover the tokenizer's tokens only: a model's vocabulary may be larger (padded to a multiple of 64 or
128), and its extra tokens, which no grammar allows, would make every xgrammar call scan them (70 us per accepted
token and 0.4 ms per bitmask row with Llama 3's 128256 over a 1000-token tokenizer, against 1 and 3 us). The bitmask
is as wide as the tokenizer; the kernel that applies it disallows everything past it.

Compilations are fair (engine/grammar_queue.py: one that runs long stops holding a thread from the small ones behind
it) and bounded: engine/structured_outputs.py limits a constraint's size, PAGODA_GRAMMAR_COMPILE_TIMEOUT_S the wait
for one. A request that goes (aborted, timed out) while its compilation waits in the queue takes it out, unless
another request waits on the same constraint; one already running finishes (xgrammar cannot stop it) into the cache.

A matcher moves only with the tokens the driver has read back, never with a token still on the device: a preempted
request's token in flight is dropped before any matcher saw it, so preemption and recompute need no rollback.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine import envs
from engine.errors import ParamError
from engine.grammar_queue import CompileQueue
from engine.outputs import GrammarBitmask, SchedulerOutput
from engine.request_output import RequestError
from engine.structured_outputs import StructuredOutputsParams, grammar_for, xgrammar_message

if TYPE_CHECKING:
    import xgrammar

    from engine.request import Request

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used out first)
NUM_COMPILE_THREADS = 2  # compilations at a time, not counting slow ones
MAX_SLOW_COMPILES = 2  # compilations running past SLOW_COMPILE_S that no longer hold one of those threads
SLOW_COMPILE_S = 1.0
XGRAMMAR_THREADS = 2  # xgrammar's threads for one compilation: at most (2 + 2) x 2 busy cores in all
BATCH_FILL_MIN_ROWS = 16  # below this a loop over the matchers beats xgrammar's thread pool


@dataclass
class GrammarStats:
    """Cumulative: compilations (cache misses) and bitmask fills (one per step with constrained rows)."""

    tokenizer_info_s: float = 0.0  # reading the tokenizer's vocabulary, once per engine
    num_compiles: int = 0
    compile_s: float = 0.0
    max_compile_s: float = 0.0
    num_cache_hits: int = 0
    num_compile_timeouts: int = 0  # requests failed for a grammar not compiled within the compile timeout
    num_compiles_cancelled: int = 0  # compilations that never ran: every request waiting for them went
    num_fills: int = 0
    num_fill_rows: int = 0
    fill_s: float = 0.0


class RequestGrammar:
    """One sequence's constraint: its compiled grammar (maybe still compiling), then its matcher."""

    def __init__(self, req_id: str, key: tuple, compiled: Future, stop_token_ids: tuple[int, ...],
                 manager: StructuredOutputManager, added_at: float):
        self.req_id = req_id
        self.key = key  # the constraint's (StructuredOutputsParams.key)
        self.compiled = compiled
        self.added_at = added_at  # on the manager's clock: the compile timeout counts from here
        # The request's EOS tokens: allowed only where the grammar may end (none: ignore_eos). Its other
        # stop_token_ids are plain text to the grammar: allowed where the grammar allows them, and sampling one
        # ends the request as a stop token does (as a stop string may, mid-grammar).
        self.stop_token_ids = stop_token_ids
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.num_accepted = 0
        self.is_finished = False  # the grammar is complete and allows nothing more
        self.error: RequestError | None = None  # why its request must fail
        self._manager = manager

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    def start(self) -> None:
        """Once compiled: creates the matcher, or records why compilation failed (a grammar the compiler refused:
        the request's fault, naming its field; anything else, such as a tokenizer it cannot read: the engine's)."""
        import xgrammar

        try:
            compiled = self.compiled.result(timeout=0)
        except ParamError as e:
            self.error = RequestError(str(e), RequestError.INVALID, e.param)
            return
        except Exception as e:  # noqa: BLE001 - anything else is the engine's fault, reported on the request
            self.error = RequestError(f"structured_outputs: the grammar did not compile: {type(e).__name__}: {e}")
            return
        # Without stop tokens (ignore_eos) the grammar alone ends the request, once nothing more can follow.
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(self.stop_token_ids) or None,
                                               terminate_without_stop_token=not self.stop_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False if the grammar rejects it (the mask should have made that
        impossible)."""
        matcher = self.matcher
        assert matcher is not None, f"{self.req_id}: a token accepted before the grammar is ready"
        if not matcher.accept_token(token_id):
            self.error = RequestError(f"structured_outputs: the grammar rejected token {token_id}")
            return False
        self.num_accepted += 1
        if token_id in self.stop_token_ids or (
                matcher.is_completed() and self._manager.allows_only_stop_tokens(matcher, self.stop_token_ids)):
            self.is_finished = True
        return True

    def valid_prefix(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` (speculative decoding) the grammar accepts from where it is, up to its
        first stop token (excluded): a draft the grammar rejects could never be accepted. The matcher is left as
        it was (rolled back)."""
        matcher = self.matcher
        if matcher is None or self.is_finished:
            return []
        n = 0
        for token_id in drafts:
            if token_id in self.stop_token_ids or not matcher.accept_token(token_id):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return drafts[:n]

    def release(self) -> None:
        self.matcher = None
        self._manager.release(self)


class StructuredOutputManager:
    """Compiles each constraint once per engine (so once per tokenizer) and keeps every live sequence's matcher."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = CACHE_SIZE,
                 compile_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.tokenizer = tokenizer
        self.vocab_size = min(len(tokenizer), vocab_size)  # the tokenizer's tokens that the model can sample
        self.eos_token_ids = tuple(sorted(t for t in eos_token_ids if t < self.vocab_size))
        self.num_words = -(-self.vocab_size // 32)
        self.cache_size = cache_size
        self.live: dict[str, RequestGrammar] = {}
        self.stats = GrammarStats()
        self.num_fill_threads = envs.get("PAGODA_GRAMMAR_THREADS") or min(8, (os.cpu_count() or 2) // 2)
        self.compile_timeout_s = (envs.get("PAGODA_GRAMMAR_COMPILE_TIMEOUT_S") if compile_timeout_s is None
                                  else compile_timeout_s)
        self.clock = clock
        self.compiles = CompileQueue(NUM_COMPILE_THREADS, MAX_SLOW_COMPILES, SLOW_COMPILE_S, clock)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._starting: list[RequestGrammar] = []  # waiting for their compilation
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._buffer = np.empty((0, self.num_words), dtype=np.int32)
        self._scratch = np.empty((1, self.num_words), dtype=np.int32)
        self._batch_matcher: xgrammar.BatchGrammarMatcher | None = None

    @property
    def num_live(self) -> int:
        return len(self.live)

    @property
    def is_compiling(self) -> bool:
        return bool(self._starting)

    # ---- requests in and out ---------------------------------------------------------------------------------
    def add(self, seqs: list[Request]) -> None:
        """Gives each sequence of one request its own RequestGrammar over one shared compilation."""
        params = seqs[0].sampling_params
        constraint = params.structured_outputs
        assert constraint is not None, f"{seqs[0].req_id}: no constraint to compile"
        compiled = self._compile(constraint)
        stop_token_ids = tuple(t for t in params.all_stop_token_ids if t in self.eos_token_ids)
        now = self.clock()
        for seq in seqs:
            seq.grammar = RequestGrammar(seq.req_id, constraint.key, compiled, stop_token_ids, self, now)
            self.live[seq.req_id] = seq.grammar
            self._starting.append(seq.grammar)

    def poll(self) -> list[RequestGrammar]:
        """Starts the matchers whose grammar has compiled; returns the grammars that failed to compile or waited
        longer than the compile timeout (their requests must fail: that releases them)."""
        self.compiles.dispatch()  # a compilation may have turned slow since
        failed, starting = [], []
        now = self.clock()
        for grammar in self._starting:
            if self.live.get(grammar.req_id) is not grammar:
                continue  # finished (aborted) while compiling
            if not grammar.compiled.done():
                if now - grammar.added_at > self.compile_timeout_s:
                    grammar.error = RequestError(f"structured_outputs: the grammar did not compile within "
                                                 f"{self.compile_timeout_s:g} s (PAGODA_GRAMMAR_COMPILE_TIMEOUT_S); "
                                                 "retry shortly", RequestError.UNAVAILABLE)
                    self.stats.num_compile_timeouts += 1
                    failed.append(grammar)
                else:
                    starting.append(grammar)
                continue
            grammar.start()
            if grammar.error is not None:
                failed.append(grammar)
        self._starting = starting
        return failed

    def wait_for_compile(self, timeout_s: float) -> None:
        """Blocks until some compilation finishes (or timeout_s), if any runs: for a step loop with nothing to do."""
        if self._starting:
            wait([g.compiled for g in self._starting], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def release(self, grammar: RequestGrammar) -> None:
        if self.live.get(grammar.req_id) is grammar:
            del self.live[grammar.req_id]
            if not grammar.compiled.done():
                self._drop_compile(grammar)

    def _drop_compile(self, gone: RequestGrammar) -> None:
        """A request that waited for its compilation went: the compilation leaves the queue unless another live
        request waits for it too (the n sequences of a request, or a request with the same constraint)."""
        if any(g.compiled is gone.compiled and self.live.get(g.req_id) is g for g in self._starting):
            return
        if self.compiles.cancel(gone.compiled):
            self.stats.num_compiles_cancelled += 1
            if self._cache.get(gone.key) is gone.compiled:
                del self._cache[gone.key]

    # ---- compilation (thread pool) -----------------------------------------------------------------------------
    def _compile(self, params: StructuredOutputsParams) -> Future:
        key = params.key
        future = self._cache.get(key)
        if future is not None and not future.cancelled() and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.stats.num_cache_hits += 1
            return future
        future = self.compiles.submit(self._compile_now, params)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile_now(self, params: StructuredOutputsParams):
        """In a pool thread: the grammar (cached, tokenizer-free) compiled against the tokenizer. A grammar that the
        compiler refuses (xgrammar raises RuntimeError) is a ParamError naming the constraint's field."""
        compiler = self._get_compiler()
        grammar = grammar_for(params)
        start = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ParamError(f"structured_outputs.{params.kind}", f"did not compile: {xgrammar_message(e)}") from None
        elapsed = time.perf_counter() - start
        with self._compiler_lock:
            self.stats.num_compiles += 1
            self.stats.compile_s += elapsed
            self.stats.max_compile_s = max(self.stats.max_compile_s, elapsed)
        return compiled

    def prepare_in_background(self) -> threading.Thread:
        """Imports xgrammar and reads the tokenizer's vocabulary on a thread of its own, so that the first constrained
        request does not wait for them: xgrammar's import pulls transformers' modelling code (4-10 s of CPU; on an
        H200's host the first 64 constrained streams through `pagoda serve` took 7.8 s against 2.9 s for the next
        64). A request that comes meanwhile waits for the same lock, as it would have waited for its own import."""
        def run():
            try:
                self._warm_up(self._get_compiler())
            except Exception:  # the first compile raises it again, where a request can be failed with it
                logger.warning("preparing structured outputs failed", exc_info=True)

        thread = threading.Thread(target=run, name="pagoda-grammar-prepare", daemon=True)
        thread.start()
        return thread

    def _warm_up(self, compiler) -> None:
        """Compiles and matches one small grammar, apart from the step's buffers and the stats: a process's first
        compile and fill pay for xgrammar's own first use (the first burst of 64 constrained streams through
        `pagoda serve` after a start ran at 0.87 of plain, the next at 0.94-1.00)."""
        import xgrammar

        compiled = compiler.compile_grammar(grammar_for(StructuredOutputsParams(json_object=True)))
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(np.empty((1, self.num_words), dtype=np.int32), 0)

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                start = time.perf_counter()
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids) or None)
                # xgrammar's own cache is unbounded: ours (the futures above) is the one cache.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=XGRAMMAR_THREADS, cache_enabled=False)
                self.stats.tokenizer_info_s = time.perf_counter() - start
            return self._compiler

    # ---- bitmasks ----------------------------------------------------------------------------------------------
    def fill_bitmask(self, req_ids: list[str], requests: dict[str, Request],
                     drafts: dict[str, list[int]] | None = None) -> GrammarBitmask:
        """The next-token bitmask of each of req_ids; a request with `drafts` gets 1 + d rows, the masks after each
        prefix of its drafts (which its grammar accepts: SpecDecoder proposed them through `valid_prefix`). A
        request that is gone (finished, aborted, preempted since) gets a row that allows everything: its sample is
        dropped anyway. The array is reused by the next fill."""
        start = time.perf_counter()
        drafts = drafts or {}
        num_rows = len(req_ids) + sum(len(drafts.get(req_id, ())) for req_id in req_ids)
        if self._buffer.shape[0] < num_rows:
            self._buffer = np.empty((max(num_rows, 2 * self._buffer.shape[0]), self.num_words), dtype=np.int32)
        bitmask = self._buffer[:num_rows]
        matchers: list[xgrammar.GrammarMatcher] = []
        rows: list[int] = []
        row_ids: list[str] = []
        for req_id in req_ids:
            req = requests.get(req_id)
            grammar = req.grammar if req is not None else None
            run = drafts.get(req_id, [])
            i = len(row_ids)
            row_ids += [req_id] * (1 + len(run))
            if grammar is None or grammar.matcher is None:
                bitmask[i:i + 1 + len(run)] = -1
            elif run:
                self._fill_draft_rows(grammar.matcher, run, bitmask, i)
            else:
                matchers.append(grammar.matcher)
                rows.append(i)
        if len(matchers) >= BATCH_FILL_MIN_ROWS and self.num_fill_threads > 1:
            if self._batch_matcher is None:
                import xgrammar

                self._batch_matcher = xgrammar.BatchGrammarMatcher(self.num_fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            for matcher, row in zip(matchers, rows):
                matcher.fill_next_token_bitmask(bitmask, row)
        stats = self.stats
        stats.num_fills += 1
        stats.num_fill_rows += num_rows
        stats.fill_s += time.perf_counter() - start
        return GrammarBitmask(row_ids, bitmask)

    def deferred_bitmask(self, awaited: dict[str, list[int]], requests: dict[str, Request]) -> GrammarBitmask:
        """The bitmask of a step that deferred its sampling (Executor.awaiting), from the grammars as the step
        before left them. A request's rows follow its drafts as far as its grammar accepts them (`valid_prefix`):
        the mask there rejects the draft the grammar would not take (or allows a stop token where the grammar may
        end), so the verification never keeps a draft past it and the positions after it need no row."""
        drafts = {}
        for req_id, run in awaited.items():
            req = requests.get(req_id)
            if run and req is not None and req.grammar is not None:
                drafts[req_id] = req.grammar.valid_prefix(run)
        return self.fill_bitmask(list(awaited), requests, drafts)

    @staticmethod
    def _fill_draft_rows(matcher, run: list[int], bitmask: np.ndarray, first: int) -> None:
        """Rows first..first + d: the mask before each draft and after the last, the matcher advanced through the
        drafts and rolled back."""
        for j, token_id in enumerate(run):
            matcher.fill_next_token_bitmask(bitmask, first + j)
            accepted = matcher.accept_token(token_id)
            assert accepted, f"draft {j} ({token_id}) is not one the grammar accepts: proposed past valid_prefix"
        matcher.fill_next_token_bitmask(bitmask, first + len(run))
        matcher.rollback(len(run))

    def launch_bitmask(self, sched: SchedulerOutput, requests: dict[str, Request]) -> GrammarBitmask | None:
        """The bitmask of the constrained requests that sample in a step, to travel with it. Only for a step whose
        constrained requests have no token in flight: their grammars are where the step starts."""
        if not self.live:
            return None
        req_ids = [req_id for req_id in sched.num_scheduled_tokens
                   if requests[req_id].grammar is not None and requests[req_id].num_pending_tokens]
        for req_id in req_ids:
            assert requests[req_id].num_pending_tokens == 1, f"{req_id}: a bitmask at launch with a token in flight"
        return self.fill_bitmask(req_ids, requests, sched.scheduled_spec_token_ids) if req_ids else None

    def allows_only_stop_tokens(self, matcher: xgrammar.GrammarMatcher, stop_token_ids: tuple[int, ...]) -> bool:
        """Whether the matcher allows nothing next but the stop tokens (it is complete: the request can end now)."""
        matcher.fill_next_token_bitmask(self._scratch, 0)
        words = self._scratch[0].view(np.uint32)
        for token_id in stop_token_ids:
            words[token_id // 32] &= np.uint32(~(1 << (token_id % 32)) & 0xFFFFFFFF)
        return not words.any()

    # ---- integrity, shutdown -----------------------------------------------------------------------------------
    def check_integrity(self, requests: dict[str, Request]) -> None:
        """Exactly the unfinished constrained requests hold a grammar, each advanced by all its output tokens."""
        expected = {req_id for req_id, req in requests.items() if req.grammar is not None}
        assert set(self.live) == expected, (f"grammars leaked {sorted(set(self.live) - expected)}, "
                                            f"lost {sorted(expected - set(self.live))}")
        for req_id in expected:
            req = requests[req_id]
            assert self.live[req_id] is req.grammar, f"{req_id}: two grammars"
            assert req.grammar.matcher is None or req.grammar.num_accepted == req.num_output_tokens, (
                f"{req_id}: its matcher accepted {req.grammar.num_accepted} of {req.num_output_tokens} tokens")

    def shutdown(self) -> None:
        self.compiles.shutdown()
