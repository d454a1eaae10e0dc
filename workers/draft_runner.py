"""`DraftRunner`: a draft model beside the target on the same worker (speculative decoding, method "draft_model";
the driver's side is engine/spec_decode.py `DraftModelProposer`).

It has its own model (a smaller one with the target's vocabulary, sharded over the same tensor-parallel ranks as
the target), its own paged KV pool and its own block allocation (a free list on each rank: the driver keeps no
books of it; every rank gets the same asks, so their books agree). It reads the token ids from the target
runner's request states on the same worker, so the driver's ask carries only request ids and counts
(engine/outputs.py `DraftAsk`).

    known tokens        t0 t1 ... t(n-1)                 (the target's state: prompt + outputs)
    draft KV            computed for c <= n - 1 of them  (c: the n of its last proposal, or 0)
    catch-up pass(es)   t(c) .. t(n-1) in (in passes of at most max_num_batched_tokens), logits of t(n-1) -> d1
    k - 1 decode passes d(j) in at position n - 1 + j -> d(j + 1)
    afterwards          c = n: the drafts' KV is written over next time, when the accepted ones are caught up on

Drafts are greedy (argmax): a one-hot draft distribution, which the verification (workers/spec_verify.py) assumes.
Sampled drafts with their probabilities are a later step.

On a GPU (unless enforce_eager) every pass of a step in flight replays the draft's own CUDA graphs (a
`CudaGraphRunner` over its model, pool and input buffers, as the target's): the k - 1 decode passes its decode
graphs, and the catch-up pass its verify graphs (at most k + 1 tokens a sequence: the accepted drafts and the
target's token; workers/cuda_graphs.py). Only a longer catch-up (a new request's prompt, a request that went some
steps without drafts) runs eagerly. The decode passes take their input tokens, the previous pass's argmax, on the
device (as the target's overlapped steps do): the host waits once, for the drafts of the whole ask.

A draft state is dropped, its blocks back on the free list, when the target runner no longer holds its request
(finished, aborted, preempted: checked at each ask), when the pool has no room for it (that request gets no drafts
this time) and, every state, when a draft forward raises (that ask gives no drafts; the next one catches up from
scratch). A request never fails for its draft. (At tensor_parallel_size > 1 a forward that raises on one rank
only leaves the others waiting in a collective: the executor then fails, as with the target's forward.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import SchedulerConfig
from engine.outputs import DraftAsk
from workers import parallel
from workers.cuda_graphs import CudaGraphRunner
from workers.inputs import InputBuffers, to_device
from workers.kv_pool import KVCaches

logger = logging.getLogger(__name__)


@dataclass
class DraftState:
    """The draft's KV of one request: its blocks and how many of the request's tokens they hold."""

    target: object  # the target runner's RequestState it follows (another object: the request was rebuilt)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


@dataclass
class _Seq:
    req_id: str
    tokens: list[int]  # the target's token ids (read, never written)
    state: DraftState
    num_drafts: int


class DraftRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: KVCaches, num_blocks: int, block_size: int,
                 device: torch.device, scheduler_config: SchedulerConfig, num_speculative_tokens: int, target,
                 use_cuda_graphs: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.target = target  # the worker's ModelRunner: its `requests` hold the token ids
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self.states: dict[str, DraftState] = {}
        self.max_tokens = scheduler_config.max_num_batched_tokens
        max_blocks = -(-(scheduler_config.max_model_len + num_speculative_tokens) // block_size)
        self.buffers = InputBuffers(self.max_tokens + scheduler_config.max_num_seqs, scheduler_config.max_num_seqs,
                                    max_blocks, block_size, device)
        self.graphs = None
        if use_cuda_graphs and device.type == "cuda":
            self.graphs = CudaGraphRunner(model, kv_caches, self.buffers, scheduler_config.max_num_seqs,
                                          spec_tokens=num_speculative_tokens)
            self.graphs.capture()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # ---- one ask -------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ask: DraftAsk) -> dict[str, list[int]]:
        """Up to ask.max_drafts[r] greedy drafts for each request r the target runner holds with ask.num_tokens[r]
        tokens; none for the others, and none at all if a forward raises."""
        self.drop_stale()
        try:
            return self._propose(ask)
        except Exception:  # noqa: BLE001 - a failing draft fails no request: this ask gives no drafts
            logger.exception("the draft model failed: no drafts this step")
            for req_id in list(self.states):
                self._drop(req_id)
            return {}

    def _propose(self, ask: DraftAsk) -> dict[str, list[int]]:
        seqs = [seq for req_id, k in ask.max_drafts.items()
                if (seq := self._prepare(req_id, ask.num_tokens.get(req_id, -1), k)) is not None]
        if not seqs:
            return {}
        first = self._catch_up(seqs)
        passes = []  # pass j: the argmax tokens [len(live)] on the device, of the sequences with more than j drafts
        live, tokens = seqs, to_device(first, torch.long, self.device)
        for j in range(1, max(seq.num_drafts for seq in seqs)):
            keep = [i for i, seq in enumerate(live) if seq.num_drafts > j]
            if len(keep) < len(live):
                tokens = tokens[to_device(np.asarray(keep), torch.long, self.device)]
                live = [live[i] for i in keep]
            # seq's draft j is the input at position n - 1 + j (n: its known tokens), fed on the device
            tokens = self._forward([seq.tokens for seq in live], [len(seq.tokens) - 1 + j for seq in live],
                                   [1] * len(live), [seq.state.block_ids for seq in live], feed=tokens)
            passes.append((live, tokens))
        drafts = {seq.req_id: [token] for seq, token in zip(seqs, first)}
        for live, tokens in passes:  # the host's one wait
            for seq, token in zip(live, tokens.tolist()):
                drafts[seq.req_id].append(token)
        for seq in seqs:
            seq.state.num_computed_tokens = len(seq.tokens)  # the drafts' KV: written over next time
        return drafts

    def _prepare(self, req_id: str, num_tokens: int, num_drafts: int) -> _Seq | None:
        """The request's draft state with blocks for its known tokens and its drafts' inputs, or None (the target
        runner does not hold it as the driver does, or the pool has no room for it)."""
        target = self.target.requests.get(req_id)
        if target is None or num_drafts < 1 or target.num_pending or len(target.token_ids) != num_tokens:
            return None
        state = self.states.setdefault(req_id, DraftState(target))
        # At least the last known token goes in (its logits give the first draft), even after a failed step.
        state.num_computed_tokens = min(state.num_computed_tokens, num_tokens - 1)
        needed = -(-(num_tokens + num_drafts - 1) // self.block_size) - len(state.block_ids)
        if needed > len(self.free_block_ids):
            self._drop(req_id)
            return None
        for _ in range(needed):
            state.block_ids.append(self.free_block_ids.pop())
        return _Seq(req_id, target.token_ids, state, num_drafts)

    def _catch_up(self, seqs: list[_Seq]) -> list[int]:
        """Runs each sequence's tokens the draft has not seen (in passes of at most max_tokens tokens, a long one
        chunked); returns each one's first draft, from the logits of its last known token."""
        first: dict[str, int] = {}
        todo = seqs
        while todo:
            batch, budget = [], self.max_tokens
            for seq in todo:
                count = min(len(seq.tokens) - seq.state.num_computed_tokens, budget)
                if count == 0:
                    break
                batch.append((seq, count))
                budget -= count
            tokens = self._forward([seq.tokens for seq, _ in batch],
                                   [seq.state.num_computed_tokens for seq, _ in batch], [c for _, c in batch],
                                   [seq.state.block_ids for seq, _ in batch])
            for (seq, count), token in zip(batch, tokens.tolist()):
                seq.state.num_computed_tokens += count
                if seq.state.num_computed_tokens == len(seq.tokens):
                    first[seq.req_id] = token
            todo = [seq for seq in todo if seq.state.num_computed_tokens < len(seq.tokens)]
        return [first[seq.req_id] for seq in seqs]

    def _forward(self, token_lists: list[list[int]], starts: list[int], counts: list[int],
                 block_ids: list[list[int]], feed: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of the draft over the flat batch (through its CUDA graphs where one fits); the argmax token
        after each sequence's last input, on the device (rank 0's logits: the other ranks learn the tokens, their
        next inputs, from its broadcast). feed: a decode pass's input tokens [B] already on the device (the host
        buffers hold placeholders for them)."""
        num_tokens, num_block_cols = self.buffers.fill(token_lists, starts, counts, block_ids)
        num_seqs, max_query_len = len(counts), max(counts)

        def write_feed():
            if feed is not None:
                self.buffers.dev["input_ids"][:num_seqs].copy_(feed)

        if max_query_len == 1 and self.graphs is not None and num_seqs <= self.graphs.max_batch:
            hidden = self.graphs.replay(num_seqs, write_feed)  # [B, hidden]
        elif feed is None and self.graphs is not None and self.graphs.can_verify(num_seqs, max_query_len):
            hidden = self.graphs.replay_verify(num_seqs, num_tokens)  # [T, hidden]: a catch-up of <= k + 1 tokens
        else:
            self.buffers.copy_to_device(num_tokens, num_seqs, num_block_cols)
            write_feed()
            ids, positions, meta = self.buffers.metadata(num_tokens, num_seqs, max_query_len, num_block_cols)
            hidden = self.model(ids, positions, self.kv_caches, meta)  # [T, hidden]
        last = hidden[to_device(np.cumsum(counts) - 1, torch.long, self.device)] if max_query_len > 1 else hidden
        logits = self.model.compute_logits(last)  # [B, V] on rank 0, None on the others
        tokens = (logits.argmax(dim=-1) if logits is not None
                  else torch.zeros(num_seqs, dtype=torch.long, device=self.device))
        return parallel.broadcast_from_rank0(tokens)

    # ---- books ---------------------------------------------------------------------------------------------------
    def drop_stale(self) -> None:
        """Frees the states of requests the target runner no longer holds (or holds as another state)."""
        for req_id, state in list(self.states.items()):
            if self.target.requests.get(req_id) is not state.target:
                self._drop(req_id)

    def _drop(self, req_id: str) -> None:
        state = self.states.pop(req_id)
        self.free_block_ids.extend(reversed(state.block_ids))

    def check_integrity(self) -> None:
        """Every block is free or held by exactly one live state, which holds enough of them."""
        self.drop_stale()
        held = [b for state in self.states.values() for b in state.block_ids]
        assert len(held) == len(set(held)), "a draft KV block held twice"
        assert not set(held) & set(self.free_block_ids), "a draft KV block both held and free"
        assert len(held) + len(self.free_block_ids) == self.num_blocks, "draft KV blocks leaked"
        for req_id, state in self.states.items():
            assert state.num_computed_tokens <= len(state.block_ids) * self.block_size, req_id
            assert state.num_computed_tokens <= len(state.target.token_ids), req_id
