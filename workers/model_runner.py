"""`ModelRunner`: SchedulerOutput -> input tensors -> forward over the paged KV pool -> sampled tokens.

It keeps a persistent state per request (token ids, block table, where computation stands), updated from the
step's diffs, and appends the tokens it samples itself, so the driver never sends them back. On rank 0 the token
histories of requests with penalties also live on the device (`TokenHistory`), written right behind each step's
sampling: penalties then need nothing from the host, and steps overlap whatever the sampling settings.

A step's batch is flat: the scheduled tokens of every request packed one after another.

    request  a: 5 prompt tokens (prefill)   b: 1 decode token   c: a 3-token chunk of a long prompt
    tokens   [a a a a a | b | c c c]        query_start_loc [0, 5, 6, 9]
    logits for: a (prompt done), b; not c (more chunks to come)

Requests with `prompt_logprobs` also get logits for their prompt positions (workers/prompt_logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import SchedulerConfig
from engine.outputs import DEVICE_DRAFT, GrammarBitmask, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from kernels.ngram import ngram_lookup
from kernels.run_ahead import fix_up_inputs
from workers.compile import CompiledForward
from workers.cuda_graphs import CudaGraphRunner
from workers.grammar_mask import apply_grammar_bitmask, constrained_req_ids
from workers.inputs import InputBuffers, to_device
from workers.kv_pool import HostKVPool, KVCaches, KVMoveError, copy_blocks
from workers.lora import LoRAManager
from workers.prompt_logprobs import PromptLogprobsBatch, compute_prompt_logprobs
from workers.sampler import (
    RowKnobs,
    SampledBatch,
    SamplingRow,
    SamplingTensors,
    finish,
    min_tokens_unsure,
    penalty_batch,
    row_knobs,
    sample_async,
)
from workers.spec_verify import VerifiedStep, VerifyRow, launch_verify, logit_indices
from workers.token_history import PenaltyBatch, TokenHistory, uses_penalties

_SEED_STRIDE = 1_000_003


def seed_key(seed: int, position: int) -> int:
    """A seeded request's noise key for the token at `position`: it depends only on the seed and the position, so
    the same tokens come whatever else is in the batch, after preemption, and with overlapped steps."""
    return (seed * _SEED_STRIDE + position) % (1 << 62)


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # kept beside token_ids so that sampling needs no copies
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    seed: int | None
    history_slot: int | None = None  # its row of the runner's TokenHistory (requests with penalties, rank 0)
    knobs: RowKnobs | None = None  # row_knobs(params): computed once, read whenever the sampled batch changes
    lora_slot: int = -1  # its LoRA adapter's slot (-1: the base model)
    # tokens of the step launched last, not yet appended: its sampled one (and the drafts of a verify step, counted
    # as accepted, as the driver counts them)
    num_pending: int = 0
    num_unsure: int = 0  # of those, the drafts (SamplingRow.num_unsure): the next step's shift takes back the rejected

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.num_pending -= 1


# the drafts a step proposed on the device: req_id -> row, drafts [D, k], how many of each row's the lookup found [D]
DeviceDrafts = tuple[dict[str, int], torch.Tensor, torch.Tensor]


@dataclass
class Forward:
    """A launched forward pass: its hidden states [T, hidden], the indices of the requests that sample, and what
    only the device knows of them: the drafts proposed there (`_propose_on_device`) and how far each sampling
    row's position moved back (`_shifted_keys`). Where a constrained row took device drafts, rank 0 copies them to
    the host right behind the lookup, before the forward (`drafts_on_host`: [P, k], -1 past what the lookup found;
    its rows as device_drafts'): the driver's bitmask follows them (VerifiedStep.awaiting_drafts)."""
    hidden: torch.Tensor
    sample_rows: list[int]
    device_drafts: DeviceDrafts | None = None
    key_shift: torch.Tensor | None = None
    drafts_on_host: SampledBatch | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: KVCaches, block_size: int, device: torch.device,
                 scheduler_config: SchedulerConfig, is_driver: bool = True, use_cuda_graphs: bool = False,
                 host_pool: HostKVPool | None = None, lora: LoRAManager | None = None, spec_tokens: int = 0,
                 ngram: tuple[int, int] | None = None):
        self.model = model
        self.lora = lora  # LoRA slots in the model's linears (workers/lora.py); None: no adapters
        self.kv_caches = kv_caches
        self.host_pool = host_pool  # the host-memory KV tier (CacheConfig.swap_space_gib); None: none
        self.block_size = block_size
        self.device = device
        self.is_driver = is_driver  # TP rank 0: samples and returns the output
        # a draft model's (workers/draft_runner.py DraftRunner.probs, shared by the worker): the distributions of
        # its last ask's sampled drafts, which their verification needs; None without a draft model
        self.draft_probs: dict | None = None
        self.requests: dict[str, RequestState] = {}
        self.scoring: set[str] = set()  # requests with prompt_logprobs whose prompt is still being computed
        self.prev_tokens: torch.Tensor | None = None  # the last launched step's sampled ids, on the device
        self.prev_rows: dict[str, int] = {}  # req_id -> row of prev_tokens
        # a verify step launched last: each row's rejected drafts ([R] on the device; None after a plain step), by
        # which the next step's positions move back when it is launched before this one is read
        self.prev_rejected: torch.Tensor | None = None
        # n-gram speculation (prompt_lookup_min, max): drafts of steps launched ahead proposed here, on the device
        # (kernels/ngram.py), from histories every rank keeps; None: drafts come from the driver only
        self.ngram = ngram
        self.lookup = ngram_lookup  # (histories [R, W], lengths [R], k, min_n, max_n) -> (drafts [R, k], found [R])
        self.spec_tokens = spec_tokens
        self.history = (TokenHistory(scheduler_config.max_num_seqs, scheduler_config.max_model_len, device)
                        if is_driver or ngram is not None else None)
        self._sampling: tuple | None = None  # (req ids, SamplingTensors, history slots) of the last sampled batch
        # a launched step whose sampling waits for a grammar bitmask
        self.awaiting: PendingStep | VerifiedStep | None = None
        max_blocks = -(-scheduler_config.max_model_len // block_size)
        self.buffers = InputBuffers(scheduler_config.max_num_batched_tokens + scheduler_config.max_num_seqs,
                                    scheduler_config.max_num_seqs, max_blocks, block_size, device,
                                    has_lora=lora is not None,
                                    full_width_tables=isinstance(getattr(model, "forward", None), CompiledForward))
        self.graphs = None
        if use_cuda_graphs and device.type == "cuda":
            # spec_tokens (num_speculative_tokens, 0: no speculation): verify graphs of 1 + k tokens a sequence too
            self.graphs = CudaGraphRunner(model, kv_caches, self.buffers, scheduler_config.max_num_seqs,
                                          spec_tokens)
            self.graphs.capture()

    # ---- persistent batch ----------------------------------------------------------------------------------------
    def update_states(self, sched: SchedulerOutput) -> None:
        self._move_kv(sched)  # first: a step that fails after this point has made its moves, as the driver assumes
        if self.lora is not None:  # the host cache's moves as the driver ordered them, then the slots'
            for adapter_id in sched.lora_evictions:
                self.lora.evict(adapter_id)
            for read_id, adapter in sched.lora_reads:
                self.lora.start_read(read_id, adapter)
        for slot, adapter in sched.lora_loads:
            self.lora.load(slot, adapter)
        for req_id in sched.finished_req_ids + sched.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            self.scoring.discard(req_id)
            if state is not None and state.history_slot is not None:
                self.history.remove(state.history_slot)
        if sched.new_reqs or sched.finished_req_ids or sched.preempted_req_ids:
            self._sampling = None  # a request id may now name another state (a preempted one came back)
        for new in sched.new_reqs:
            self.requests[new.req_id] = self._new_state(new)
            if new.sampling_params.prompt_logprobs is not None:
                self.scoring.add(new.req_id)
        for cached in sched.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.replaces_block_ids:
                state.block_ids = list(cached.new_block_ids)
            else:  # (the blocks a verify step's rejected drafts gave back go first, as the driver's did)
                if cached.num_kept_blocks is not None:
                    del state.block_ids[cached.num_kept_blocks:]
                state.block_ids.extend(cached.new_block_ids)
            # The runner keeps its own count: the driver's counts the drafts of a verify step in flight as accepted,
            # and this runner may have read that step back already (a Ray rank reads each step before the next).
            assert state.num_computed_tokens <= cached.num_computed_tokens, \
                f"{cached.req_id}: {state.num_computed_tokens} computed here, {cached.num_computed_tokens} there"

    def _move_kv(self, sched: SchedulerOutput) -> None:
        """The step's KV moves; a failure among them is a KVMoveError (the executor's end, not the step's)."""
        try:
            self._make_kv_moves(sched)
        except Exception as e:
            raise KVMoveError(f"moving KV blocks failed: {type(e).__name__}: {e}") from e

    def _make_kv_moves(self, sched: SchedulerOutput) -> None:
        """The step's KV moves, before its forward (outside any CUDA graph), in the contract's order: offloads to
        the host tier, copy-on-write, onloads from the host tier. On CUDA offloads run on a stream of their own,
        beside the step; the next step waits for them at its start."""
        pool = self.host_pool
        if pool is None:
            assert not (sched.kv_offloads or sched.kv_onloads), "the step moves KV to a host tier this rank lacks"
            copy_blocks(self.kv_caches, sched.block_copies)
            return
        # The block manager never has a step write a block it offloads (engine/block_manager.py _pop_free; a full,
        # committed block is not written by its holders), so the offloads need not finish before this forward.
        assert not {d for d, _ in sched.kv_offloads} & {d for _, d in sched.block_copies + sched.kv_onloads}, \
            "a step writes a device block it offloads"
        pool.wait_for_offloads()
        pool.offload(sched.kv_offloads)
        copy_blocks(self.kv_caches, sched.block_copies)
        pool.onload(sched.kv_onloads)

    def _new_state(self, new: NewRequestData) -> RequestState:
        slot = None
        if self.history is not None and (uses_penalties(new.sampling_params) or self.ngram is not None):
            slot = self.history.add(list(new.prompt_token_ids), list(new.output_token_ids))
        return RequestState(new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids),
                            new.prompt_token_ids, list(new.output_token_ids), new.sampling_params, list(new.block_ids),
                            new.num_computed_tokens, new.sample_seed, slot, row_knobs(new.sampling_params),
                            lora_slot=new.lora_slot)

    # ---- one step ------------------------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.execute_model_async(sched).result()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput, defer_sampling: bool = False,
                            ) -> PendingStep | VerifiedStep:
        """Launches the step and returns before its sampled tokens reach the host. A request whose previous token
        is still on the device (sampled by the step launched just before) reads it from there.

        Constrained requests sample with `sched.grammar_bitmask`; without one (defer_sampling) the forward is
        launched and sampling waits for `sample(bitmask)` (PendingStep's, or a verify step's VerifiedStep's), which
        the driver calls once it has read the previous step's tokens and advanced its grammars (the forward runs on
        the device meanwhile)."""
        assert self.awaiting is None, f"step launched while {self.awaiting.bitmask_req_ids} await their bitmask"
        self.update_states(sched)
        if sched.is_empty:
            return PendingStep(self, [])
        states = [self.requests[req_id] for req_id in sched.num_scheduled_tokens]
        if self.lora is not None and self.lora.load_errors:
            self._check_lora_slots(states)
        counts = list(sched.num_scheduled_tokens.values())
        forward = self._forward(states, counts, sched.scheduled_spec_token_ids)
        hidden, sample_rows = forward.hidden, forward.sample_rows
        prompt_logprobs = None
        if self.scoring:  # (a set test: decode steps without such requests pay nothing)
            starts = [state.num_computed_tokens for state in states]
            prompt_logprobs = compute_prompt_logprobs(self.model, hidden, states, starts, counts, self.is_driver)
        sampling_states = [states[i] for i in sample_rows]
        for state, count in zip(states, counts):
            state.num_computed_tokens += count
        if self.scoring:
            self.scoring -= {s.req_id for s in states if s.num_computed_tokens >= len(s.prompt_token_ids) - 1}
        if not sampling_states:
            return PendingStep(self, [], prompt_logprobs=prompt_logprobs)
        # Every rank awaits the bitmask with rank 0 (which alone applies it): the others' part of sampling is
        # rank 0's broadcast of the tokens, and a rank held in it could not answer the step's launch. A step that
        # waits samples once the step before is read back (the driver collects it first), so the host then knows
        # every token before: no row's key or count moves on the device (Forward.key_shift is dropped).
        constrained = constrained_req_ids(sampling_states)
        defer = bool(constrained) and sched.grammar_bitmask is None
        assert defer_sampling or not defer, f"{constrained} follow a grammar, but the step carries no bitmask"
        if sched.scheduled_spec_token_ids:  # speculative: every row verified (workers/spec_verify.py)
            return self._verify(sched, sampling_states, counts, forward, prompt_logprobs, constrained if defer
                                else [])
        logits = self.model.compute_logits(hidden[self._sample_indices(counts, sample_rows)])
        step = PendingStep(self, sampling_states, logits, prompt_logprobs)
        if defer:
            step.bitmask_req_ids = constrained
            self.awaiting = step
            return step
        step.key_shift = forward.key_shift
        self._sample(step, sched.grammar_bitmask)
        return step

    def _check_lora_slots(self, states: list[RequestState]) -> None:
        """A request whose adapter's slot failed to load fails the step (the driver then retries its requests one
        by one, so that only those of the adapter fail)."""
        errors = self.lora.load_errors
        broken = next((s for s in states if s.lora_slot in errors), None)
        if broken is not None:
            raise ValueError(f"{broken.req_id}: {errors[broken.lora_slot]}")

    @torch.inference_mode()
    def _sample(self, step: PendingStep, bitmask: GrammarBitmask | None) -> None:
        self.awaiting = None
        states, logits = step.states, step.logits
        rows = []
        if self.is_driver:
            if bitmask is not None:
                apply_grammar_bitmask(logits, bitmask, [s.req_id for s in states])
            rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, self._sample_seed(s),
                                s.num_pending, s.knobs, s.num_unsure) for s in states]
            tensors, penalties = self._sampling_inputs(states, rows, logits.shape[1])
            batch = sample_async(logits, rows, tensors=tensors, penalties=penalties, in_place=True,
                                 key_shift=step.key_shift)
        else:
            batch = SampledBatch(torch.zeros(len(states), dtype=torch.long, device=self.device), [])
        from workers import parallel

        if parallel.get_tp_size() > 1:  # the other ranks learn the tokens so their states stay in step
            batch.tokens = parallel.broadcast_from_rank0(batch.tokens)
        self._append_history(states, batch.tokens[:, None])  # the histories take this step's tokens on the device
        for state in states:
            state.num_pending += 1
        self.prev_tokens, self.prev_rejected = batch.tokens, None
        self.prev_rows = {state.req_id: i for i, state in enumerate(states)}
        step.sampled, step.rows, step.logits, step.bitmask_req_ids = batch.start_copy(), rows, None, []

    @staticmethod
    def _sample_seed(state: RequestState) -> int | None:
        """The noise key of the token a seeded request samples next (`seed_key`); None: unseeded."""
        return None if state.seed is None else seed_key(state.seed, state.num_computed_tokens)

    def _sampling_inputs(self, states: list[RequestState], rows: list[SamplingRow], vocab_size: int,
                         ) -> tuple[SamplingTensors, PenaltyBatch | None]:
        """The rows' knobs, rebuilt only when the sampled requests change, and the penalized rows' histories."""
        req_ids = tuple(s.req_id for s in states)
        if self._sampling is None or self._sampling[0] != req_ids:
            tensors = SamplingTensors.build(rows, vocab_size, self.device)
            slots = to_device([states[i].history_slot for i in tensors.penalty_rows], torch.long, self.device)
            self._sampling = (req_ids, tensors, slots)
        _, tensors, slots = self._sampling
        if not tensors.penalty_rows:
            return tensors, None
        # Filled lengths: the host's tokens plus the one in flight (already written on the device).
        max_tokens = max(len(states[i].token_ids) + states[i].num_pending for i in tensors.penalty_rows)
        return tensors, penalty_batch(tensors, *self.history.read(slots, max_tokens))

    def _forward(self, states: list[RequestState], counts: list[int], drafts: dict[str, list[int]]) -> Forward:
        """Builds the step's inputs and runs the model: a CUDA graph for decode batches and for verify steps of
        decodes only (each its last token and its drafts: workers/cuda_graphs.py), eager otherwise.
        A request's drafts (speculative decoding) are inputs after its known tokens; DEVICE_DRAFT positions are
        proposed here, on the device (`_propose_on_device`).

        A request whose last input token is still on the device (sampled by the step launched just before, not yet
        read back) reads it there. After a verify step that was not read back, the driver scheduled the request as
        if every draft had been accepted: its positions, slots and sequence length move back on the device by the
        drafts that step rejected (`_fix_up`)."""
        starts = [s.num_computed_tokens for s in states]
        token_lists, fed, shifted, proposed = [], [], [], []  # (flat position, previous row), (row, first, count)
        offset = 0
        for i, (state, start, count) in enumerate(zip(states, starts, counts)):
            row_drafts = drafts.get(state.req_id, ())
            on_device = len(row_drafts) if row_drafts and row_drafts[0] == DEVICE_DRAFT else 0
            tokens = state.token_ids + row_drafts if row_drafts and not on_device else state.token_ids
            token_lists.append(tokens)
            last = start + count - 1 - on_device  # its last input that is not a device draft
            assert last < len(tokens) + state.num_pending, f"{state.req_id}: scheduled past its known tokens"
            assert start + count <= len(state.block_ids) * self.block_size, f"{state.req_id}: too few blocks"
            if last >= len(tokens):  # the token sampled just before (after a verify step: its last kept token)
                assert last == len(tokens) + state.num_pending - 1 and state.req_id in self.prev_rows, \
                    f"{state.req_id}: lost token"
                fed.append((offset + last - start, self.prev_rows[state.req_id]))
                if self.prev_rejected is not None:
                    shifted.append((i, offset, count, self.prev_rows[state.req_id]))
            if on_device:
                proposed.append((state, offset + count - on_device, on_device))
            offset += count
        lora_slots = [s.lora_slot for s in states] if self.lora is not None else None
        num_tokens, num_block_cols = self.buffers.fill(token_lists, starts, counts, [s.block_ids for s in states],
                                                       lora_slots)
        sample_rows = [i for i, (s, start, count) in enumerate(zip(states, starts, counts))
                       if start + count == len(s.token_ids) + s.num_pending + len(drafts.get(s.req_id, ()))]
        draft_positions, draft_ids, device_drafts = self._propose_on_device(proposed)
        drafts_on_host = None
        if device_drafts is not None and self.is_driver and constrained_req_ids(s for s, _, _ in proposed):
            _, ids, found = device_drafts
            past = torch.arange(ids.shape[1], device=ids.device)[None, :] >= found[:, None]
            drafts_on_host = SampledBatch(ids.masked_fill(past, -1), []).start_copy()
        feed = self._fix_up(fed, shifted, draft_positions, draft_ids)
        max_query_len = max(counts)
        if max_query_len == 1 and self.graphs is not None and len(states) <= self.graphs.max_batch:
            hidden = self.graphs.replay(len(states), feed)
        elif drafts and self.graphs is not None and self.graphs.can_verify(len(states), max_query_len) \
                and len(sample_rows) == len(states) \
                and all(count == 1 + len(drafts.get(s.req_id, ())) for s, count in zip(states, counts)):
            hidden = self.graphs.replay_verify(len(states), num_tokens, feed)  # decodes, 0..k drafts
        else:
            self.buffers.copy_to_device(num_tokens, len(states), num_block_cols)
            feed()
            use_lora = lora_slots is not None and max(lora_slots) >= 0  # a step of base rows skips the adapters
            ids, positions, meta = self.buffers.metadata(num_tokens, len(states), max_query_len, num_block_cols,
                                                         use_lora)
            hidden = self.model(ids, positions, self.kv_caches, meta)
        return Forward(hidden, sample_rows, device_drafts, self._shifted_keys(states, sample_rows, shifted),
                       drafts_on_host)

    def _shifted_keys(self, states: list[RequestState], sample_rows: list[int],
                      shifted: list[tuple[int, int, int, int]]) -> torch.Tensor | None:
        """[len(sample_rows)] on the device: how far back each sampling row's position moves (`_fix_up`), which its
        noise key follows when it is seeded (sampler.shift_keys) and its count of outputs when it may be short of
        min_tokens (sampler.apply_min_tokens); None when no such row moves."""
        row_of = {i: j for j, i in enumerate(sample_rows)}
        moved = [(row_of[i], prev) for i, _, _, prev in shifted
                 if (s := states[i]).seed is not None
                 or min_tokens_unsure(s.params.min_tokens, len(s.output_token_ids) + s.num_pending, s.num_unsure)]
        if not moved:
            return None
        index = to_device([r for r, _ in moved] + [p for _, p in moved], torch.long, self.device)
        rows, prev = index.split(len(moved))
        shift = torch.zeros(len(sample_rows), dtype=torch.long, device=self.device)
        return shift.index_copy_(0, rows, self.prev_rejected.index_select(0, prev))

    def _propose_on_device(self, proposed: list[tuple[RequestState, int, int]],
                           ) -> tuple[list[int], torch.Tensor, DeviceDrafts | None]:
        """The n-gram drafts of the rows that take DEVICE_DRAFT positions ((state, flat position of its first draft
        slot, its number of slots)), from their device histories, which already hold the tokens of the step in
        flight: the flat positions of the draft slots, the drafts in that order [sum of slots] on the device, and
        for the verification each row's drafts and how many of them the lookup found (`Forward.device_drafts`;
        None without device drafts)."""
        if not proposed:
            return [], torch.empty(0, dtype=torch.long, device=self.device), None
        assert self.ngram is not None and self.history is not None, "device drafts without the n-gram lookup"
        k = self.spec_tokens
        slots = to_device([state.history_slot for state, _, _ in proposed], torch.long, self.device)
        width = max(len(state.token_ids) + state.num_pending for state, _, _ in proposed)  # >= each history's length
        draft_ids, found = self.lookup(*self.history.read_tokens(slots, width), k, *self.ngram)
        positions, picks = [], []
        for j, (_, first, count) in enumerate(proposed):
            positions += range(first, first + count)
            picks += range(j * k, j * k + count)
        rows = {state.req_id: j for j, (state, _, _) in enumerate(proposed)}
        flat = draft_ids.view(-1)  # (each row k slots: every draft in order, as the common verify step takes them)
        if len(picks) != flat.numel():
            flat = flat.index_select(0, to_device(picks, torch.long, self.device))
        return positions, flat, (rows, draft_ids, found)

    def _fix_up(self, fed: list[tuple[int, int]], shifted: list[tuple[int, int, int, int]],
                draft_positions: list[int], draft_ids: torch.Tensor):
        """A function that writes into this step's device inputs what only the device knows: the tokens the step
        before sampled (`fed`: flat position, its row there), the drafts proposed on the device, and, after a verify
        step not yet read back, the positions, KV slots and sequence lengths of the rows that follow it (`shifted`:
        row, first flat position, tokens, its row there), moved back by the drafts that step rejected."""
        if not (fed or draft_positions):
            return lambda: None
        token_index = [offset + j for _, offset, count, _ in shifted for j in range(count)]
        index = to_device([p for p, _ in fed] + [r for _, r in fed] + draft_positions + token_index
                          + [i for i, _, count, _ in shifted for _ in range(count)]
                          + [r for _, _, count, r in shifted for _ in range(count)]
                          + [i for i, _, _, _ in shifted] + [r for _, _, _, r in shifted], torch.long, self.device)
        counts = (len(fed), len(draft_positions), len(token_index), len(shifted))
        prev, rejected, dev, bs = self.prev_tokens, self.prev_rejected, self.buffers.dev, self.block_size

        def fix_up() -> None:
            fix_up_inputs(dev["input_ids"], dev["positions"], dev["slot_mapping"], dev["seq_lens"],
                          dev["block_tables"], bs, prev, rejected, index, counts, draft_ids)

        return fix_up

    @torch.inference_mode()
    def _verify(self, sched: SchedulerOutput, states: list[RequestState], counts: list[int], forward: Forward,
                prompt_logprobs: PromptLogprobsBatch | None, defer: list[str]) -> VerifiedStep:
        """A step with drafts: scores every sampling row's last 1 + d positions; `_sample_verify` keeps the accepted
        drafts and one token of the target's, now, or once the driver supplies the bitmask of the constrained rows
        in `defer` (VerifiedStep.sample)."""
        drafts = [sched.scheduled_spec_token_ids.get(s.req_id, []) for s in states]
        index = logit_indices(counts, forward.sample_rows, [len(d) for d in drafts])
        logits = self.model.compute_logits(forward.hidden[to_device(index, torch.long, self.device)])
        device_drafts = self._verified_drafts(states, forward.device_drafts) if self.is_driver else None
        step = VerifiedStep(self, states, drafts, prompt_logprobs, logits, device_drafts)
        if defer:
            proposed = forward.device_drafts
            step.defer(defer, None if forward.drafts_on_host is None or proposed is None
                       else (proposed[0], forward.drafts_on_host))
            self.awaiting = step
            return step
        self._sample_verify(step, sched.grammar_bitmask, forward.key_shift)
        return step

    @torch.inference_mode()
    def _sample_verify(self, step: VerifiedStep, bitmask: GrammarBitmask | None,
                       key_shift: torch.Tensor | None = None) -> None:
        """The verification of the step's logits (rank 0 decides, the others learn the tokens), queued without a
        wait. The next step may be launched first: the kept tokens go into the device histories here, and the last
        of each row, with the drafts it rejected, is what that step reads (`_fix_up`). Deferred, no key moves
        (`execute_model_async`)."""
        logits, device_drafts = step.logits, step.device_drafts
        self.awaiting = None
        states, drafts = step.states, step.drafts
        launched = found = None
        if self.is_driver:
            rows = [VerifyRow(s, d, None if (key := self._sample_seed(s)) is None else (key - len(d)) % (1 << 62),
                              self._draft_probs(s.req_id, d)) for s, d in zip(states, drafts)]
            if self.draft_probs is not None:
                self.draft_probs.clear()  # the last ask's: this step verified them
            launched = launch_verify(logits, rows, bitmask, device_drafts=device_drafts,
                                     key_shift=key_shift, histories=self._verify_histories(states))
            tokens = launched.tokens
            found = device_drafts[1] if device_drafts is not None else None
        else:
            tokens = torch.full((len(states), 1 + max(map(len, drafts))), -1, dtype=torch.int64, device=self.device)
        from workers import parallel

        if parallel.get_tp_size() > 1:
            tokens = parallel.broadcast_from_rank0(tokens)
        self._append_history(states, tokens)
        kept = (tokens >= 0).sum(dim=1)
        num_drafts = to_device([len(d) for d in drafts], torch.long, self.device)
        self.prev_tokens = tokens.gather(1, (kept - 1)[:, None]).squeeze(1)
        self.prev_rejected = num_drafts + 1 - kept
        self.prev_rows = {state.req_id: i for i, state in enumerate(states)}
        for state, d in zip(states, drafts):
            state.num_pending += 1 + len(d)  # (as the driver counts them until the step is read back)
            state.num_unsure += len(d)
        step.sampled(tokens, launched, found)

    def _verify_histories(self, states: list[RequestState]) -> tuple | None:
        """The rows' device token histories (TokenHistory.read) when any uses penalties (each such row keeps one),
        for the penalties at each verified position; None otherwise."""
        if self.history is None or not any(uses_penalties(s.params) for s in states):
            return None
        slots = to_device([0 if s.history_slot is None else s.history_slot for s in states], torch.long, self.device)
        return self.history.read(slots, max(len(s.token_ids) + s.num_pending for s in states))

    def _verified_drafts(self, states: list[RequestState],
                         proposed: DeviceDrafts | None,
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The device drafts (`Forward.device_drafts`) of this step's sampling rows ([R, k], and how many the lookup
        found [R]: 0 for a row without), or None: the step's drafts came from the driver."""
        if proposed is None:
            return None
        rows, draft_ids, found = proposed
        pick = [rows.get(s.req_id, 0) for s in states]
        has = [s.req_id in rows for s in states]
        if len(rows) == len(states) and all(has) and pick == list(range(len(states))):
            return draft_ids, found  # (every sampling row proposed, in order: the common verify step)
        index = to_device(pick + has, torch.long, self.device)
        pick_t, has_t = index.split(len(states))
        return draft_ids.index_select(0, pick_t), found.index_select(0, pick_t) * has_t

    def _append_history(self, states: list[RequestState], tokens: torch.Tensor) -> None:
        """The step's new tokens ([R, W], each row's then -1) into the device histories of the rows that keep one."""
        if self.history is None or not self.history.in_use:  # (a plain decode step without penalties: nothing)
            return
        rows = [i for i, s in enumerate(states) if s.history_slot is not None]
        if rows:
            index = to_device(rows + [states[i].history_slot for i in rows], torch.long, self.device)
            self.history.append(index[len(rows):], tokens, index[:len(rows)])

    def _draft_probs(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The distributions a draft model drew these drafts from in the last ask ([d, V]; the driver may have cut
        them to a prefix), or None: one-hot drafts (greedy ones, n-gram ones, or drafts not from the last ask)."""
        entry = self.draft_probs.get(req_id) if self.draft_probs is not None and drafts else None
        if entry is None or entry[1] is None or entry[0][:len(drafts)] != drafts:
            return None
        return entry[1][:len(drafts)]

    def append_verified(self, state: RequestState, drafts: list[int], new: list[int]) -> None:
        """A verify step's kept tokens (VerifiedStep.result): the state's tokens, and its computed count without the
        rejected drafts. Their blocks go when the driver's next step for it says (CachedRequestData.num_kept_blocks):
        a step launched before this one was read back may have its next tokens there."""
        state.token_ids.extend(new)
        state.output_token_ids.extend(new)
        state.num_pending -= 1 + len(drafts)
        state.num_unsure -= len(drafts)
        state.num_computed_tokens -= len(drafts) + 1 - len(new)  # the rejected drafts' KV is not kept

    def check_block_tables(self, block_tables: dict[str, list[int]]) -> None:
        """Each request's table here starts with the driver's (Executor.check_integrity)."""
        for req_id, table in block_tables.items():
            state = self.requests.get(req_id)
            assert state is not None, f"{req_id} runs on the driver, not here"
            assert state.block_ids[:len(table)] == table, f"{req_id}: blocks {state.block_ids} here, {table} there"

    def _sample_indices(self, counts: list[int], sample_rows: list[int]) -> torch.Tensor:
        """The last token of each sampling request, in the flat batch."""
        ends = np.cumsum(counts) - 1
        return to_device(ends[sample_rows], torch.long, self.device)


class PendingStep:
    """A launched step; `result()` waits for its tokens, appends them to the request states and returns the
    ModelRunnerOutput (None on ranks other than 0). With `bitmask_req_ids`, it waits for `sample(bitmask)` first."""

    def __init__(self, runner: ModelRunner, states: list[RequestState], logits: torch.Tensor | None = None,
                 prompt_logprobs: PromptLogprobsBatch | None = None):
        self.runner = runner
        self.states = states
        self.logits = logits  # [N, V] until sampled
        self.bitmask_req_ids: list[str] = []  # deferred sampling: the constrained rows whose bitmask it awaits
        self.sampled: SampledBatch | None = None  # (tokens only on ranks other than 0), its host copy started
        self.rows: list[SamplingRow] = []
        self.prompt_logprobs = prompt_logprobs  # rank 0 only
        self.key_shift: torch.Tensor | None = None  # how far its sampling rows' positions moved back (ModelRunner)
        self._output: ModelRunnerOutput | None = None

    def awaiting_drafts(self) -> dict[str, list[int]]:
        """The rows awaiting their bitmask (VerifiedStep's: with the drafts each verifies; none here)."""
        return {req_id: [] for req_id in self.bitmask_req_ids}

    def sample(self, bitmask: GrammarBitmask) -> None:
        """Deferred sampling: applies the driver's bitmask and samples."""
        assert self.bitmask_req_ids and self.runner.awaiting is self, "this step does not await a bitmask"
        self.runner._sample(self, bitmask)

    def result(self) -> ModelRunnerOutput | None:
        if self._output is not None:
            return self._output
        if not self.states:
            self._output = ModelRunnerOutput()
        else:
            if self.sampled is None:
                raise RuntimeError(f"the step was never sampled: {self.bitmask_req_ids} await their bitmask")
            token_ids, logprobs = finish(self.sampled, self.rows)
            self._append(token_ids)
            self._output = ModelRunnerOutput([s.req_id for s in self.states], token_ids, logprobs)
        if self.prompt_logprobs is not None:
            self._output.prompt_logprobs = self.prompt_logprobs.outputs()
        return self._output if self.runner.is_driver else None

    def _append(self, token_ids: list[int]) -> None:
        for state, token_id in zip(self.states, token_ids):
            state.append(token_id)
