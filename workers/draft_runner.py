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

A greedy request's drafts are the argmax (a one-hot draft distribution). A sampled request's are drawn from the
draft's distribution at the request's temperature, q = softmax(logits / T) (Gumbel-max with noise keys of its own:
salted, so independent of the target's acceptance and residual draws; a seeded request's follow its seed and
positions), and rank 0 keeps each ask's q rows (`probs`: req_id -> (drafts, [d, V] float32)) for the verification
of the next step, whose rejection sampler accepts with min(1, p / q) (workers/spec_verify.py). Temperature is the
only knob q takes: any q keeps the target's distribution exact, and top-k / top-p / penalties stay the target's.

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
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import SchedulerConfig
from engine.outputs import DraftAsk
from kernels.sampling import gumbel_ref
from workers import parallel
from workers.cuda_graphs import CudaGraphRunner
from workers.inputs import InputBuffers, to_device
from workers.kv_pool import KVCaches
from workers.model_runner import seed_key

logger = logging.getLogger(__name__)

_NOISE_SALT = 0x1D8E4E27C47D124F  # the drafts' noise keys: apart from the target's at the same position


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
    inv_temperature: float  # 0: greedy drafts (argmax); else drawn from softmax(logits * inv_temperature)
    seed: int | None  # the target request's seed (its drafts' noise follows it)


@dataclass
class _Sampling:
    """How a pass picks each row's token: inv_temperature [B] (0: argmax) and noise keys [B], on the device."""

    inv_temperature: torch.Tensor
    keys: torch.Tensor


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
        # rank 0: each request of the last ask -> (its drafts, the [d, V] float32 distributions they were drawn
        # from, None for greedy drafts); read by the target runner's verification (the worker shares this dict)
        self.probs: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        self._random = random.Random()
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
        """Up to ask.max_drafts[r] drafts for each request r the target runner holds with ask.num_tokens[r] tokens
        (greedy or drawn from q, as the request samples); none for the others, and none at all if a forward
        raises."""
        self.drop_stale()
        self.probs.clear()
        try:
            return self._propose(ask)
        except Exception:  # noqa: BLE001 - a failing draft fails no request: this ask gives no drafts
            logger.exception("the draft model failed: no drafts this step")
            self.probs.clear()
            for req_id in list(self.states):
                self._drop(req_id)
            return {}

    def _propose(self, ask: DraftAsk) -> dict[str, list[int]]:
        seqs = [seq for req_id, k in ask.max_drafts.items()
                if (seq := self._prepare(req_id, ask.num_tokens.get(req_id, -1), k)) is not None]
        if not seqs:
            return {}
        first, first_probs = self._catch_up(seqs)
        passes = []  # pass j: the tokens [len(live)] on the device (and q) of the sequences with more than j drafts
        live, tokens = seqs, to_device(first, torch.long, self.device)
        for j in range(1, max(seq.num_drafts for seq in seqs)):
            keep = [i for i, seq in enumerate(live) if seq.num_drafts > j]
            if len(keep) < len(live):
                tokens = tokens[to_device(np.asarray(keep), torch.long, self.device)]
                live = [live[i] for i in keep]
            # seq's draft j is the input at position n - 1 + j (n: its known tokens), fed on the device
            positions = [len(seq.tokens) - 1 + j for seq in live]
            tokens, probs = self._forward([seq.tokens for seq in live], positions, [1] * len(live),
                                          [seq.state.block_ids for seq in live], feed=tokens,
                                          sampling=self._sampling(live, [p + 1 for p in positions]))
            passes.append((live, tokens, probs))
        drafts = {seq.req_id: [token] for seq, token in zip(seqs, first)}
        q_rows: dict[str, list[torch.Tensor]] = {seq.req_id: [row] for seq, row in zip(seqs, first_probs)}
        for live, tokens, probs in passes:  # the host's one wait
            for i, (seq, token) in enumerate(zip(live, tokens.tolist())):
                drafts[seq.req_id].append(token)
                if seq.inv_temperature:  # (a pass with a sampled row has probs)
                    q_rows[seq.req_id].append(probs[i])
        for seq in seqs:
            seq.state.num_computed_tokens = len(seq.tokens)  # the drafts' KV: written over next time
            if self.target.is_driver:
                rows = q_rows[seq.req_id]
                self.probs[seq.req_id] = (drafts[seq.req_id], torch.stack(rows) if seq.inv_temperature else None)
        return drafts

    def _sampling(self, seqs: list[_Seq], positions: list[int]) -> _Sampling | None:
        """The pass's picks for seqs drafting the tokens at `positions` (None: every row greedy)."""
        if not any(seq.inv_temperature for seq in seqs):
            return None
        keys = [seed_key(seq.seed, pos) ^ _NOISE_SALT if seq.seed is not None
                else self._random.getrandbits(62) for seq, pos in zip(seqs, positions)]
        return _Sampling(to_device([seq.inv_temperature for seq in seqs], torch.float32, self.device),
                         to_device(keys, torch.long, self.device))

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
        params = target.params
        return _Seq(req_id, target.token_ids, state, num_drafts,
                    0.0 if params.is_greedy else 1.0 / params.temperature, target.seed)

    def _catch_up(self, seqs: list[_Seq]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Runs each sequence's tokens the draft has not seen (in passes of at most max_tokens tokens, a long one
        chunked); returns each one's first draft, from the logits of its last known token, and the distribution it
        was drawn from (None for greedy drafts)."""
        first: dict[str, tuple[int, torch.Tensor | None]] = {}
        todo = seqs
        while todo:
            batch, budget = [], self.max_tokens
            for seq in todo:
                count = min(len(seq.tokens) - seq.state.num_computed_tokens, budget)
                if count == 0:
                    break
                batch.append((seq, count))
                budget -= count
            seqs_in = [seq for seq, _ in batch]
            tokens, probs = self._forward([seq.tokens for seq in seqs_in],
                                          [seq.state.num_computed_tokens for seq in seqs_in], [c for _, c in batch],
                                          [seq.state.block_ids for seq in seqs_in],
                                          sampling=self._sampling(seqs_in, [len(seq.tokens) for seq in seqs_in]))
            for i, ((seq, count), token) in enumerate(zip(batch, tokens.tolist())):
                seq.state.num_computed_tokens += count
                if seq.state.num_computed_tokens == len(seq.tokens):
                    first[seq.req_id] = (token, None if probs is None or not seq.inv_temperature else probs[i])
            todo = [seq for seq in todo if seq.state.num_computed_tokens < len(seq.tokens)]
        return [first[seq.req_id][0] for seq in seqs], [first[seq.req_id][1] for seq in seqs]

    def _forward(self, token_lists: list[list[int]], starts: list[int], counts: list[int],
                 block_ids: list[list[int]], feed: torch.Tensor | None = None, sampling: _Sampling | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of the draft over the flat batch (through its CUDA graphs where one fits): the token after
        each sequence's last input, on the device (the argmax, or drawn where `sampling` says; rank 0's logits: the
        other ranks learn the tokens, their next inputs, from its broadcast), and on rank 0 with `sampling` the
        distributions [B, V] float32 they were drawn from. feed: a decode pass's input tokens [B] already on the
        device (the host buffers hold placeholders for them)."""
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
        probs = None
        if logits is None:
            tokens = torch.zeros(num_seqs, dtype=torch.long, device=self.device)
        elif sampling is None:
            tokens = logits.argmax(dim=-1)
        else:  # Gumbel-max: a draw from q = softmax(logits / T); rows at inverse temperature 0 take the argmax
            x = logits.float()
            probs = torch.softmax(x * sampling.inv_temperature[:, None], dim=-1)
            noise = gumbel_ref(sampling.keys, torch.arange(x.shape[-1], device=x.device)[None, :])
            tokens = torch.where(sampling.inv_temperature > 0, (probs.log() + noise).argmax(dim=-1), x.argmax(dim=-1))
        return parallel.broadcast_from_rank0(tokens), probs

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
