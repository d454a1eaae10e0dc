"""Iteration-level scheduler: each step fills one token budget with running requests first (decodes and the rest of
chunked prefills), then new or preempted requests, under `max_num_seqs`.

When blocks run out the newest running request is preempted: its blocks are freed and it goes back to the front of
the waiting queue, to be recomputed later (prefix-cache hits make that cheap; with a host KV tier its blocks are
copied back from there). Never an error.

A step that fails (not fatally) fails no request by itself: its requests are preempted as suspects (`isolate`), and
a suspect then runs alone in its steps until it samples again, so that only a request that fails on its own is
failed (LLMEngine._fail_step).
"""

from __future__ import annotations

import time
from collections import deque

from engine.block_manager import Allocation, BlockManager
from engine.config import SchedulerConfig
from engine.lora import LoRASlots
from engine.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.spec_decode import SpecDecodeStats


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora_slots: LoRASlots | None = None):
        self.config = config
        self.block_manager = block_manager
        self.lora_slots = lora_slots  # LoRA: a request runs only with its adapter in a GPU slot
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_since_last_step: list[str] = []  # the workers must drop these
        self.isolated_since_last_step: list[str] = []  # preempted by isolate(): the workers must drop these too
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()

    # ---- requests in and out -------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.req_id not in self.requests, f"duplicate request id {req.req_id}"
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop string, abort, error): frees its blocks. Idempotent."""
        assert status.is_finished, status
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.finished_since_last_step.append(req_id)
        elif req in self.waiting:
            self.waiting.remove(req)  # waiting requests hold no state on the workers
        req.status = status
        self.block_manager.free(req)
        self._release_lora(req)
        if req.grammar is not None:
            req.grammar.release()
        return req

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- schedule ------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_since_last_step,
                              preempted_req_ids=self.isolated_since_last_step)
        self.finished_since_last_step, self.isolated_since_last_step = [], []
        budget = self.config.max_num_batched_tokens
        if self.lora_slots is not None:  # the adapters of waiting requests, read into host memory ahead
            self.lora_slots.prefetch(r.lora for r in self.waiting if r.lora is not None)
        suspect = next((r for r in self.running if r.is_suspect), None)
        if suspect is not None:  # it runs alone until it samples
            self._schedule_running(out, budget, [suspect])
        elif any(r.is_suspect for r in self.waiting):
            self._schedule_waiting(out, budget, suspect_only=True)
            if not out.num_scheduled_tokens:  # no room for it yet: the others run (and free blocks) meanwhile
                self._schedule_running(out, budget, self.running)
        else:
            budget = self._schedule_running(out, budget, self.running)
            if not out.preempted_req_ids:
                self._schedule_waiting(out, budget)
        out.kv_offloads, out.block_copies, out.kv_onloads = self.block_manager.take_transfers()
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
            if self.lora_slots.host is not None:
                out.lora_evictions, out.lora_reads = self.lora_slots.host.take_commands()
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            num_drafts = len(out.scheduled_spec_token_ids.get(req_id, ()))
            if req.num_computed_tokens + num_tokens == req.num_known_tokens + num_drafts:
                req.num_pending_tokens += 1  # this step samples its next token
                req.num_pending_drafts += num_drafts
            req.num_computed_tokens += num_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, candidates: list[Request]) -> int:
        i = 0
        while i < len(candidates) and budget > 0:
            req = candidates[i]
            num_new = min(req.num_known_tokens - req.num_computed_tokens, budget)
            if num_new <= 0 or req.num_known_tokens - req.num_prompt_tokens >= req.max_tokens:
                i += 1
                continue
            drafts = req.spec_token_ids[:budget - num_new]  # speculative decoding: proposed for a decode step
            num_new += len(drafts)
            while (growth := self.block_manager.grow(req, num_new)) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if growth is None:
                break  # req itself was preempted: nothing after it is left either
            out.cached_reqs.append(CachedRequestData(req.req_id, growth.new_block_ids, req.num_computed_tokens,
                                                     growth.replaces_block_ids, growth.num_kept_blocks))
            out.num_scheduled_tokens[req.req_id] = num_new
            if drafts:
                out.scheduled_spec_token_ids[req.req_id] = drafts
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, suspect_only: bool = False) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if suspect_only and (not req.is_suspect or out.new_reqs):
                skipped.append(req)
                continue
            if req.grammar is not None and not req.grammar.is_ready:
                skipped.append(req)  # its grammar is still compiling
                continue
            if self._waits_for_leader(req):
                skipped.append(req)  # n > 1: its leader's prompt is not computed yet
                continue
            if not self._can_run_adapter(req):
                skipped.append(req)  # its adapter is still being read, or every slot is in use: it waits
                continue
            allocation = self._admit(req, budget)
            if allocation is None:
                self.waiting.appendleft(req)
                break
            if req.lora is not None:
                assert self.lora_slots is not None, "a LoRA request in an engine without LoRA slots"
                req.lora_slot = self.lora_slots.acquire(req.lora)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            out.new_reqs.append(NewRequestData(
                req.req_id, req.prompt_token_ids, list(req.output_token_ids), req.sampling_params,
                allocation.block_ids, req.num_computed_tokens, req.sample_seed, req.lora_slot))
            out.num_scheduled_tokens[req.req_id] = allocation.num_new_tokens
            budget -= allocation.num_new_tokens
        self.waiting.extendleft(reversed(skipped))

    def _waits_for_leader(self, req: Request) -> bool:
        """n > 1: a sibling waits while its running leader still computes the prompt (maybe again, after a
        preemption), then shares the leader's blocks (steps run in order: this step reads them after they are
        written)."""
        leader = req.leader
        return (leader is not None and leader.status == RequestStatus.RUNNING
                and leader.num_computed_tokens < req.num_prompt_tokens - 1)

    def _admit(self, req: Request, budget: int) -> Allocation | None:
        """Gives req its blocks (what is already computed, and room for this step's tokens), or None. A sibling
        tries its leader's blocks once: not admitted now, it later starts like a request of its own."""
        leader, req.leader = req.leader, None
        if leader is not None and leader.status != RequestStatus.RUNNING:
            leader = None  # not running: it holds no blocks to share
        allocation = self.block_manager.admit(req, budget, leader)
        if allocation is not None:
            req.num_computed_tokens = allocation.num_computed_tokens
            if req.num_cached_tokens < 0:  # its first admission
                req.num_cached_tokens = allocation.num_computed_tokens
        return allocation

    def isolate(self, req_ids: list[str]) -> None:
        """The requests of a failed step go back to the waiting queue as suspects (their blocks freed, to be
        recomputed); each then runs alone until it samples a token, so a request that fails on its own is found."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            self._preempt(req, None)
            req.is_suspect = True

    def _can_run_adapter(self, req: Request) -> bool:
        """A request of the base model, or one whose adapter has a GPU slot or can get one now."""
        if req.lora is None:
            return True
        assert self.lora_slots is not None, "a LoRA request in an engine without LoRA slots"
        return self.lora_slots.can_acquire(req.lora.request.id)

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            assert self.lora_slots is not None
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1

    def _preempt(self, req: Request, out: SchedulerOutput | None) -> None:
        self.running.remove(req)
        self.block_manager.preempt(req)
        self._release_lora(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preempted_tokens = min(req.num_computed_tokens, req.num_tokens)
        req.num_computed_tokens = 0
        req.num_pending_tokens = req.num_pending_drafts = 0  # a step in flight for it is dropped: recomputed
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        (out.preempted_req_ids if out is not None else self.isolated_since_last_step).append(req.req_id)

    # ---- results -------------------------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Appends sampled tokens, ends requests at eos / stop ids / length, publishes full blocks to the prefix
        cache. Returns the requests that got a token (finished ones included)."""
        for req_id in sched.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                self.block_manager.commit(req)
        for req_id, chunk in result.prompt_logprobs.items():
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.add_prompt_logprobs(chunk)
        updated = []
        for req_id, token_id, logprobs in zip(result.req_ids, result.sampled_token_ids, result.logprobs):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since the step was scheduled
            req.num_pending_tokens -= 1
            req.is_suspect = False
            tokens, token_logprobs = [token_id], [logprobs]
            drafts = sched.scheduled_spec_token_ids.get(req_id)
            if drafts is not None:
                req.num_pending_drafts -= len(drafts)
                accepted = result.accepted_draft_ids.get(req_id, [])
                tokens = accepted + tokens
                token_logprobs = result.accepted_draft_logprobs.get(req_id, [None] * len(accepted)) + token_logprobs
                self._take_back_rejected(req, len(drafts), len(accepted), result.draft_counts.get(req_id))
            if self._cannot_stop(req, tokens):  # (a speculative run: its tokens at once)
                req.extend_output(tokens, token_logprobs)
                req.num_step_tokens = len(tokens)
                updated.append(req)
                continue
            req.num_step_tokens = 0
            for token_id, logprobs in zip(tokens, token_logprobs):
                req.append_output(token_id, logprobs)
                req.num_step_tokens += 1
                status = self._stop_status(req, token_id)
                if status is not None:  # a stop cuts a speculative run short
                    self.finish_request(req_id, status)
                    break
            updated.append(req)
        return updated

    def _take_back_rejected(self, req: Request, num_drafts: int, num_accepted: int,
                            num_proposed: int | None = None) -> None:
        """Speculative decoding: the rejected drafts' positions are not computed after all; their blocks go back
        (never hashed: commit publishes only blocks of known tokens). num_proposed: of the positions, the drafts the
        workers found (device drafts; None: all of them)."""
        self.spec_stats.record(num_drafts if num_proposed is None else num_proposed, num_accepted)
        req.num_computed_tokens -= num_drafts - num_accepted
        self.block_manager.shrink(req)

    @staticmethod
    def _cannot_stop(req: Request, tokens: list[int]) -> bool:
        """Whether no token of the run can end the request (`_stop_status` of each would be None): no grammar, no
        stop id among them, and its length stays short of max_tokens."""
        stop_ids = req.sampling_params.all_stop_token_ids
        return (req.grammar is None and req.num_output_tokens + len(tokens) < req.max_tokens
                and not any(t in stop_ids for t in tokens))

    def _stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        if req.grammar is not None and not req.grammar.accept(token_id):
            return RequestStatus.FINISHED_ERROR  # never with the mask applied: fail it, not the engine
        return self._check_stop(req, token_id)

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens and token_id in params.all_stop_token_ids:
            req.stop_reason = token_id if token_id in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_finished:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing but a stop token could follow
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
