"""`LLMEngine`: the driver loop. add_request / step / abort; turns sampled tokens into text and deltas.

    step():  scheduler.schedule() ─► executor.launch() ─► executor.collect() ─► scheduler.update_from_output()
             ─► detokenize, stop strings ─► a RequestDelta for each request due one (engine/request_group.py)

A step stays in flight across step() calls (async scheduling): overlapped, the next step is launched before it is
read back; synchronized (drafts, a bitmask that must travel with the step), it is read back first and its deltas
made once the next is launched (docs/architecture.md, the step protocol).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig, resolve_device
from engine.errors import ParamError
from engine.executor import Executor, ExecutorError, ExecutorPicker, StepHandle
from engine.grammar import StructuredOutputManager
from engine.lora import LoRAAdapter, LoRARequest, LoRASlots, load_error, read_adapter
from engine.onload_cost import NEVER_ONLOAD, OnloadCost
from engine.outputs import SchedulerOutput
from engine.prompts import Prompt, PromptLimits, longest_token_chars, process_prompt
from engine.request import Request, RequestStatus
from engine.request_group import RequestGroup, TokenStrings
from engine.request_output import RequestDelta, RequestError
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import SpecDecoder
from engine.startup import BackgroundPhase, StartupTimes
from engine.tokenizer import TokenizerChild, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int  # counters since start
    generation_tokens: int
    num_steps: int = 0
    num_finished: dict[str, int] | None = None  # finish reason -> requests
    device_memory_used_bytes: int = 0  # set by the engine loop from the executor (0 on CPU)
    device_utilization: float = 0.0  # 0..1, where the device reports it
    # the host KV tier (--swap-space): new requests' prompt tokens looked up while it exists and found there, bytes
    # written to it and copied back (all ranks), its usage; preempted requests' computed tokens it held when they
    # were preempted, those copied back when they resumed, and those computed again
    num_host_kv_blocks: int = 0
    host_prefix_cache_queries: int = 0
    host_prefix_cache_hits: int = 0
    kv_offloaded_bytes: int = 0
    kv_onloaded_bytes: int = 0
    host_kv_cache_usage: float = 0.0
    swapped_out_tokens: int = 0
    swapped_in_tokens: int = 0
    preemption_recomputed_tokens: int = 0
    # speculative decoding (vLLM's spec_decode_*): steps that carried drafts, drafts, accepted drafts (by position)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] | None = None
    # LoRA (vLLM's lora_requests_info): the adapters of the running and of the waiting requests, by name, and the
    # GPU slots (0: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0


@dataclass
class StepTiming:
    """Where step() spends its time, cumulative. wait_s is the part spent waiting for the device to finish a step
    launched earlier (with overlap): a share near zero means the host, not the device, sets the pace."""

    num_steps: int = 0
    busy_s: float = 0.0  # inside step()
    wait_s: float = 0.0  # of which, waiting for a step's results

    def since(self, earlier: StepTiming) -> dict:
        steps = self.num_steps - earlier.num_steps
        busy, wait = self.busy_s - earlier.busy_s, self.wait_s - earlier.wait_s
        return {"steps": steps, "ms_per_step": 1e3 * busy / max(steps, 1),
                "device_wait_ms_per_step": 1e3 * wait / max(steps, 1)}


@dataclass
class InFlight:
    """A launched step, until the engine reads it back."""

    sched: SchedulerOutput
    handle: StepHandle
    launched_at: float  # time.perf_counter()
    overlapped: bool  # launched before the step before it was read back
    missed_drafts: int = 0  # draft positions its proposer found nothing for (SpecDecoder.observe)


class LLMEngine:
    def __init__(self, config: EngineConfig, pick_executor: ExecutorPicker):
        """`pick_executor` is the caller's (cluster.executors.pick_executor; engine/ imports no executor). Loads the
        tokenizer on a thread of its own while the executor loads the model (the tokenizer's load is mostly
        transformers' import, seconds on a cold process); joined before anything reads it. For a GPU model the load
        itself runs in a child process, started first (engine/tokenizer.py TokenizerChild). A failed load raises here
        as it would inline, once the executor is up, and releases the executor."""
        self.config = config
        self.startup = StartupTimes()  # imports, the executor's (rank 0's) phases, tokenizer_wait; tokenizer beside
        child = TokenizerChild(config.model.tokenizer_path) if _expects_gpu(config) else None  # before the imports
        # torch and the kernels before the tokenizer's thread starts importing transformers, which imports torch too:
        # two threads importing one package at once can deadlock in importlib.
        try:
            with self.startup.phase("imports"):
                make_executor = pick_executor(config)
        except BaseException:
            if child is not None:
                child.close()
            raise
        tokenizer = BackgroundPhase("tokenizer", lambda: _load_tokenizer(config.model, child))
        self.executor = self._start_executor(lambda: make_executor(config))
        try:
            self.tokenizer, max_chars_per_token = tokenizer.join(self.startup)
        except BaseException:
            self.executor.shutdown()
            raise
        block_size = config.cache.block_size
        num_blocks = self.executor.num_kv_blocks
        self.max_model_len = min(config.model.max_model_len, num_blocks * block_size)
        if self.max_model_len < config.model.max_model_len:
            logger.warning("max_model_len lowered from %d to %d: the KV pool holds %d blocks of %d tokens",
                           config.model.max_model_len, self.max_model_len, num_blocks, block_size)
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                          self.executor.num_host_kv_blocks, self._min_onload_blocks(),
                                          write_back=config.cache.kv_offload_policy == "write-back",
                                          write_back_ahead=self._blocks_a_step())
        self.lora_slots = (LoRASlots(config.lora.max_loras, config.lora.max_cpu_loras) if config.lora is not None
                           else None)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.lora_slots)
        self.loras: dict[int, LoRAAdapter] = {}  # adapter id -> the adapter its first request read and checked
        self.spec = SpecDecoder(config.speculative, self.executor) if config.speculative is not None else None
        self._speculating = False  # this step's drafts (SpecDecoder.decide): the step runs without overlap
        self.groups: dict[str, RequestGroup] = {}
        self.vocab_size = config.model.vocab_size
        self.limits = PromptLimits(self.vocab_size, self.max_model_len, config.scheduler.max_num_seqs,
                                   max_chars_per_token)
        self.eos_token_ids = set(config.model.eos_token_ids) | _tokenizer_eos(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        if resolve_device(config.parallel.device) == "cuda":  # on CPU it would cost every engine, tests included
            self.structured.prepare_in_background()
        self.token_strings = TokenStrings(self.tokenizer)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished: dict[str, int] = {}  # finish reason -> requests
        self.step_tokens: list[int] = []  # tokens of each step since the last take_step_tokens() (bounded)
        self._pending: InFlight | None = None  # the step launched and not yet read back
        self._read_at = 0.0  # time.perf_counter() when the last step was read back
        self._read_verify = False  # whether that step was a verify step
        self.timing = StepTiming()
        self._ids = itertools.count()

    def _blocks_a_step(self) -> int:
        """The most device blocks one step can take: its token budget's, and a block for each running request that
        crosses into a new one."""
        scheduler = self.config.scheduler
        return -(-scheduler.max_num_batched_tokens // self.config.cache.block_size) + scheduler.max_num_seqs

    def _min_onload_blocks(self) -> int:
        """The fewest host-tier blocks worth copying back (CacheConfig.min_onload_blocks, else the cost model's for
        this model's blocks: engine/onload_cost.py)."""
        cache = self.config.cache
        if cache.min_onload_blocks is not None or not self.executor.num_host_kv_blocks:
            return cache.min_onload_blocks or 1
        cost = OnloadCost(cache.onload_gb_per_s * 1e9, cache.onload_latency_s, cache.prefill_tokens_per_s)
        block_bytes = self.executor.kv_block_bytes // self.config.parallel.tensor_parallel_size  # ranks copy at once
        blocks = cost.min_onload_blocks(cache.block_size, block_bytes)
        logger.info("host KV tier: a prefix continued on the host is copied back from %s (block of %d bytes a rank, "
                    "%.1f GB/s, %.0f us a step, prefill %.0f tok/s)",
                    "never" if blocks == NEVER_ONLOAD else f"{blocks} blocks", block_bytes, cache.onload_gb_per_s,
                    cache.onload_latency_s * 1e6, cache.prefill_tokens_per_s)
        return blocks

    def _start_executor(self, make_executor: Callable[[], Executor]) -> Executor:
        start = time.perf_counter()
        executor = make_executor()
        phases = StartupTimes(executor.startup_phases())
        # What the phases do not cover: starting worker processes and their rendezvous (tensor parallel).
        phases.add("workers_start", max(0.0, time.perf_counter() - start - phases.total_s()))
        self.startup.merge(phases)
        return executor

    # ---- requests ------------------------------------------------------------------------------------------------
    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Validates a prompt and its params against the model; returns (text, token ids). Raises ParamError."""
        return process_prompt(prompt, params, self.tokenizer, self.limits)

    def add_request(self, request_id: str | None, prompt: Prompt, params: SamplingParams, stream: bool = True,
                    lora_request: LoRARequest | None = None) -> str:
        _, token_ids = self.process_prompt(prompt, params)
        return self.add_processed(request_id, token_ids, params, stream, lora_request=lora_request)

    def add_processed(self, request_id: str | None, token_ids: list[int], params: SamplingParams,
                      stream: bool = True, arrival_time: float | None = None,
                      lora_request: LoRARequest | None = None) -> str:
        """Adds a validated prompt. stream=False: the request's only delta is its last (the whole output).
        lora_request: the adapter it runs with (its files are read and checked the first time its id comes)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ParamError(None, f"request id {request_id!r} is already in use")
        lora = self.lora_adapter(lora_request) if lora_request is not None else None
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        params.all_stop_token_ids = tuple(sorted(stop_ids))
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        arrival_time = arrival_time or time.time()
        seqs: list[Request] = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i
            seqs.append(Request(seq_id, token_ids, params, max_tokens, parent_id=request_id, index=i,
                                leader=seqs[0] if i else None, sample_seed=seed, arrival_time=arrival_time,
                                lora=lora))
        self.groups[request_id] = RequestGroup(request_id, token_ids, params, seqs, self.tokenizer,
                                               self.token_strings, stream, arrival_time)
        if params.structured_outputs is not None:
            self.structured.add(seqs)  # compiles off this thread; the scheduler admits them once it is done
        for seq in seqs:
            self.scheduler.add_request(seq)
        self.num_prompt_tokens += len(token_ids)
        return request_id

    def lora_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter of a request, read and checked against the model once per id; ParamError (a ValueError)
        naming it if LoRA is off, its files are bad, or its id names another adapter already."""
        if self.config.lora is None:
            raise ParamError("lora_request", "LoRA adapters need an engine started with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ParamError("lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}")
        adapter = self.loras.get(lora_request.id)
        if adapter is None:
            adapter = read_adapter(lora_request, self.config.model.hf_config, self.config.lora.max_lora_rank)
            self.loras[lora_request.id] = adapter
        elif adapter.request != lora_request:
            raise ParamError("lora_request", f"id {lora_request.id} is adapter {adapter.request.name!r} at "
                                             f"{adapter.request.path!r} already, not {lora_request.name!r} at "
                                             f"{lora_request.path!r}")
        return adapter

    def abort_request(self, request_ids: str | list[str]) -> list[RequestDelta]:
        """Ends requests at once, freeing their blocks; returns their last deltas (finish_reason "abort")."""
        deltas = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.get(request_id)
            if group is None:
                continue
            for seq in group.seqs:
                self.scheduler.finish_request(seq.req_id, RequestStatus.FINISHED_ABORTED)
            deltas.append(self._emit(group, time.monotonic()))
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or self._pending is not None

    # ---- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One scheduling step. With overlap, step N+1 is scheduled and launched before step N's tokens are read
        back, so the host's work hides behind the device's; the deltas returned are then step N's."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.timing.num_steps += 1
            self.timing.busy_s += time.perf_counter() - start

    def _step(self) -> list[RequestDelta]:
        deltas = self._start_grammars() if self.structured.is_compiling else []
        if self.lora_slots is not None and self.lora_slots.num_reading:
            deltas += self._finish_lora_reads()
        num_speculating = self.spec.decide(len(self.scheduler.running)) if self.spec is not None else 0
        self._speculating = num_speculating > 0
        overlap = self._can_overlap()
        # Without overlap (drafts, a grammar bitmask that must travel with the step) the step in flight is read
        # back first, its tokens feeding this step's drafts and bitmask, but its deltas are made only once this
        # step is launched: the host's work on them still hides behind the device's.
        collected = self._collect_pending() if not overlap else (None, None, [])
        # draft positions the proposer found nothing for (SpecDecoder.propose): observed as drafts not accepted.
        # Overlapped, the workers propose on the device, after the step in flight.
        missed_drafts = (self.spec.propose(self.scheduler.running, num_speculating, on_device=overlap)
                         if self.spec is not None else 0)
        sched = self.scheduler.schedule()
        if self._is_idle(sched):
            if self._pending is None and collected[0] is None:
                self.structured.wait_for_compile(timeout_s=0.01)  # nothing to run: rather than spin
                if self.lora_slots is not None and self.lora_slots.num_reading:
                    time.sleep(0.001)  # (nor spin while the workers read adapters)
            return deltas + self._deltas(collected) + self._finish_pending()
        if not (overlap and self.executor.supports_deferred_sampling):
            sched.grammar_bitmask = self.structured.launch_bitmask(sched, self.scheduler.requests)
        launched_at = time.perf_counter()
        try:
            handle = self.executor.launch(sched)
        except ExecutorError as e:
            return deltas + self._deltas(collected) + self._finish_pending() + self._fail_step(sched, e)
        in_flight = InFlight(sched, handle, launched_at, overlap, missed_drafts)
        if overlap and sched.scheduled_spec_token_ids and self.spec is not None:
            self.spec.num_steps_ahead += 1
        if not overlap:
            self._pending = in_flight
            if not self._can_run_ahead():  # read back at once: its deltas come from this call
                return deltas + self._deltas(collected) + self._finish_pending()
            return deltas + self._deltas(collected)
        # Deferred sampling: step N+1's forward runs while step N's tokens advance the grammars, and N+1 samples
        # with the bitmask they give, before N's deltas are made.
        requests = self.scheduler.requests  # (read before N's tokens may end some of them)
        constrained = self.structured.live and any(requests[r].sampling_params.structured_outputs is not None
                                                   for r in sched.num_scheduled_tokens)  # as the runner tells them
        collected = self._collect_pending()
        if constrained:  # (a Ray executor asked about a step with none would wait for its end to answer)
            self._supply_bitmask(handle)
        self._pending = in_flight
        return deltas + self._deltas(collected)

    def _can_run_ahead(self) -> bool:
        """Whether a step may stay in flight when step() returns (async scheduling, on an executor whose launch
        returns before the step ends)."""
        return self.config.scheduler.async_scheduling and self.executor.supports_overlap

    def _can_overlap(self) -> bool:
        # Every sampling setting can run a step ahead of its last token: penalties read the token histories that
        # the workers keep on the device. A grammar bitmask that must travel with its step needs the last token on
        # the host, unless the executor can defer sampling until the driver supplies it.
        if not self._can_run_ahead():
            return False
        # Drafts on the host are proposed from the tokens of the step before, and a verify step in flight leaves
        # the next step's positions to the drafts it keeps: both overlap only where the workers propose on the device
        # and fix the next step's inputs up there (SpecDecoder.can_run_ahead).
        if self._speculating or (self._pending is not None and self._pending.sched.scheduled_spec_token_ids):
            if self.spec is None or not self.spec.can_run_ahead:
                return False
        return (self.executor.supports_deferred_sampling or not self.structured.num_live
                or not any(req.grammar is not None for req in self.scheduler.running))

    @staticmethod
    def _is_idle(sched) -> bool:
        return sched.is_empty and not (sched.finished_req_ids or sched.preempted_req_ids or sched.kv_offloads
                                       or sched.lora_reads or sched.lora_evictions)

    def _finish_pending(self) -> list[RequestDelta]:
        """Reads back the step in flight, advances its requests and makes their deltas."""
        return self._deltas(self._collect_pending())

    def _collect_pending(self) -> tuple[SchedulerOutput | None, list[Request] | None, list[RequestDelta]]:
        """Reads back the step in flight (if any) and advances its requests: (its SchedulerOutput, the sequences
        that got a token, the deltas of requests its failure failed)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None, None, []
        sched, handle = pending.sched, pending.handle
        start = time.perf_counter()
        try:
            if handle.error is not None:  # its sample() failed
                raise handle.error
            result = self.executor.collect(handle)
        except ExecutorError as e:
            self.timing.wait_s += time.perf_counter() - start
            return sched, None, self._fail_step(sched, e)
        end = time.perf_counter()
        self.timing.wait_s += end - start
        stats = self.scheduler.spec_stats
        drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        updated = self.scheduler.update_from_output(sched, result)
        if self.spec is not None:  # its drafts' acceptance; its time for the cost model, from its launch, or
            # overlapped, from the end of the step before it (the device ran that one until then)
            missed = pending.missed_drafts + sum(len(sched.scheduled_spec_token_ids[r]) - n  # (device drafts)
                                                 for r, n in result.draft_counts.items())
            self.spec.observe(stats.num_draft_tokens - drafts + missed, stats.num_accepted_tokens - accepted)
            if sched.is_decode_only:  # a step with prompt chunks runs eagerly: its time prices no verify step
                self.spec.cost.record(sched.total_num_scheduled_tokens, end - max(pending.launched_at, self._read_at))
            verify = bool(sched.scheduled_spec_token_ids)
            if verify and self._read_verify:  # the period between consecutive verify steps' read-backs
                self.spec.record_verify_period(pending.overlapped, end - self._read_at)
            self._read_verify = verify
        self._read_at = end
        return sched, updated, []

    def _deltas(self, collected) -> list[RequestDelta]:
        sched, seqs, failed = collected
        return failed if seqs is None else self._process(sched, seqs)

    # ---- LoRA --------------------------------------------------------------------------------------------------
    def _finish_lora_reads(self) -> list[RequestDelta]:
        """The adapters every rank has read into host memory since the last step become ready for a GPU slot; one
        whose read failed fails its waiting requests (only those) and is read again when a request next names it."""
        try:
            reads = self.executor.take_lora_reads()
        except ExecutorError as e:  # a dead rank: the next launch says so
            logger.error("polling the workers' adapter reads failed: %s", e)
            return []
        host = self.lora_slots.host if self.lora_slots is not None else None
        assert host is not None, "adapter reads without a host cache"
        deltas = []
        for read_id, error in reads.items():
            adapter = host.finish(read_id, error)
            if adapter is None or error is None:
                continue
            logger.error("LoRA adapter %r failed to load: %s", adapter.request.name, error)
            self.loras.pop(adapter.request.id, None)
            adapter_id = adapter.request.id
            parents = [r.parent_id for r in self.scheduler.waiting if r.lora is not None
                       and r.lora.request.id == adapter_id]
            deltas += self._fail_requests(parents, RequestError.from_exception(load_error(adapter, error)))
        return deltas

    # ---- structured outputs --------------------------------------------------------------------------------------
    def _start_grammars(self) -> list[RequestDelta]:
        """Matchers for the grammars compiled since the last step; a request whose grammar failed fails alone."""
        deltas = []
        for grammar in self.structured.poll():
            req = self.scheduler.requests.get(grammar.req_id)
            if req is not None and grammar.error is not None:  # (poll gives only the failed)
                deltas += self._fail_requests([req.parent_id], grammar.error)
        return deltas

    def _supply_bitmask(self, handle: StepHandle) -> None:
        """Deferred sampling: the bitmask of the step's constrained rows, from the grammars as the step before left
        them, with a row for each position of their drafts the grammar reaches (a request that step ended gets a
        row that allows everything: its sample is dropped)."""
        try:
            awaited = self.executor.awaiting(handle)
            if awaited:
                self.executor.sample(handle, self.structured.deferred_bitmask(awaited, self.scheduler.requests))
        except ExecutorError as e:
            handle.error = e  # raised where the step is collected, as its other failures are

    def _fail_step(self, sched, error: ExecutorError) -> list[RequestDelta]:
        """A fatal error fails every request of the step (the engine stops next). Otherwise a step of one request
        fails that request; the requests of a larger step are isolated (Scheduler.isolate) and retried one by one,
        so a request that breaks the step on its own fails alone and the others go on."""
        seqs = [r for r in (self.scheduler.requests.get(i) for i in sched.num_scheduled_tokens) if r is not None]
        if not error.is_fatal and len(seqs) > 1:
            logger.warning("step of %d requests failed (%s): retrying them one at a time", len(seqs), error)
            self.scheduler.isolate([r.req_id for r in seqs])
            return []
        logger.error("step failed, failing %d requests: %s", len(seqs), error)
        return self._fail_requests([r.parent_id for r in seqs], RequestError(str(error)))

    def _process(self, sched, seqs: list[Request]) -> list[RequestDelta]:
        """Detokenizes the sequences that got a token in a step (ending those that hit a stop string) and makes
        the deltas due."""
        self._record_step_tokens(sched.total_num_scheduled_tokens)
        touched: dict[str, RequestGroup] = {}
        for seq in seqs:
            group = self.groups.get(seq.parent_id)
            if group is None:
                continue
            num_new = seq.num_step_tokens
            self.num_generation_tokens += num_new
            detokenizer = group.detokenizers[seq.index]
            num_read = len(detokenizer.token_ids)
            stop = detokenizer.update(seq.output_token_ids[-num_new:])
            num_past_stop = num_new - (len(detokenizer.token_ids) - num_read)
            if num_past_stop:  # a stop string ended a speculative run early: the tokens after it are not output
                del seq.output_token_ids[-num_past_stop:], seq.output_logprobs[-num_past_stop:]
                self.num_generation_tokens -= num_past_stop
                if seq.is_finished:  # (by a stop token or its length, after the stop string): the string ends it
                    seq.status = RequestStatus.FINISHED_STOPPED
                    seq.stop_reason = stop
            if stop is not None and not seq.is_finished:
                self.scheduler.finish_request(seq.req_id, RequestStatus.FINISHED_STOPPED)
                seq.stop_reason = stop
            touched[group.request_id] = group
        now, interval = time.monotonic(), self.config.stream_interval_s
        return [self._emit(group, now) for group in touched.values() if group.wants_delta(now, interval)]

    def _record_step_tokens(self, num_tokens: int) -> None:
        if len(self.step_tokens) < 100_000:  # nobody takes them (offline): stop recording
            self.step_tokens.append(num_tokens)

    def take_step_tokens(self) -> list[int]:
        """The number of tokens of each step since the last call (the iteration-tokens histogram)."""
        tokens, self.step_tokens = self.step_tokens, []
        return tokens

    def _emit(self, group: RequestGroup, now: float, error: RequestError | None = None) -> RequestDelta:
        if error is None and group.is_finished:  # a grammar that rejected a token says so
            error = next((s.grammar.error for s in group.seqs if s.grammar is not None and s.grammar.error), None)
        delta = group.make_delta(now, error)
        if delta.finished:
            del self.groups[group.request_id]
            reason = "error" if error else next((s.status.finish_reason for s in group.seqs), None) or "stop"
            self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        return delta

    def _fail_requests(self, request_ids: list[str], error: RequestError) -> list[RequestDelta]:
        """Ends the requests at once, each with its last delta carrying `error` (finish_reason "error")."""
        deltas, now = [], time.monotonic()
        for parent_id in dict.fromkeys(request_ids):
            group = self.groups.get(parent_id)
            if group is None:
                continue
            for seq in group.seqs:
                self.scheduler.finish_request(seq.req_id, RequestStatus.FINISHED_ERROR)
            deltas.append(self._emit(group, now, error))
        return deltas

    def fail_all(self, error: str) -> list[RequestDelta]:
        """The engine cannot go on (its loop died): every request fails, the engine's fault."""
        return self._fail_requests(list(self.groups), RequestError(error))

    def get_stats(self) -> EngineStats:
        bm, spec = self.block_manager, self.scheduler.spec_stats
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, bm.usage, bm.num_blocks,
                           bm.prefix_queries_tokens, bm.prefix_hits_tokens, self.scheduler.num_preemptions,
                           self.num_prompt_tokens, self.num_generation_tokens, self.timing.num_steps,
                           dict(self.num_finished), num_host_kv_blocks=bm.num_host_blocks,
                           host_prefix_cache_queries=bm.host_queries_tokens,
                           host_prefix_cache_hits=bm.host_hits_tokens,
                           kv_offloaded_bytes=bm.num_offloaded_blocks * self.executor.kv_block_bytes,
                           kv_onloaded_bytes=bm.num_onloaded_blocks * self.executor.kv_block_bytes,
                           host_kv_cache_usage=bm.host_usage, swapped_out_tokens=bm.swapped_out_tokens,
                           swapped_in_tokens=bm.swapped_in_tokens,
                           preemption_recomputed_tokens=bm.preemption_recomputed_tokens,
                           spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
                           spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
                           spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_position),
                           **self._lora_stats())

    def _lora_stats(self) -> dict:
        if self.lora_slots is None:
            return {}

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora.request.name for r in requests if r.lora is not None}))

        return {"running_lora_adapters": names(self.scheduler.running),
                "waiting_lora_adapters": names(self.scheduler.waiting), "max_loras": self.lora_slots.num_slots}

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        # the workers' own books (a draft model's KV blocks), and their block tables against the driver's
        self.executor.check_integrity({r.req_id: self.block_manager.table(r) for r in self.scheduler.running})
        for req in self.scheduler.running:
            assert req.status == RequestStatus.RUNNING, req
        if self.lora_slots is not None:
            users = [0] * self.lora_slots.num_slots
            for req in self.scheduler.running:
                if req.lora is not None:
                    users[req.lora_slot] += 1
            self.lora_slots.check_integrity(users)
        self.structured.check_integrity(self.scheduler.requests)
        if not self.groups:
            assert not self.scheduler.requests, f"requests left: {list(self.scheduler.requests)}"
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "blocks leaked"

    def shutdown(self) -> None:
        self._pending = None
        self.structured.shutdown()
        self.executor.shutdown()


def _load_tokenizer(model_config, child: TokenizerChild | None) -> tuple[object, int]:
    """The tokenizer and its longest token's length (a scan of the vocabulary), on the tokenizer's thread."""
    tokenizer = load_tokenizer(model_config.tokenizer_path, model_config.chat_template, child)
    return tokenizer, longest_token_chars(tokenizer)


def _expects_gpu(config: EngineConfig) -> bool:
    """Whether the model will run on a GPU, known before torch is imported (the tokenizer's child process starts
    first: engine/tokenizer.py TokenizerChild): 'auto' counts a visible NVIDIA device node. A wrong guess only
    moves the tokenizer's load between processes."""
    device = config.parallel.device
    return device == "cuda" or (device == "auto" and os.path.exists("/dev/nvidiactl"))


def _tokenizer_eos(tokenizer) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if isinstance(eos, int) else set()
