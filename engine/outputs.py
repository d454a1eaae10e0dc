"""The step contract between the driver's scheduler and the workers: plain, picklable dataclasses, no tensors.

A request crosses the boundary once, as `NewRequestData` (its token ids, sampling params and block ids); after that a
step carries only diffs (`CachedRequestData`: new block ids and where computation stands). Workers keep a persistent
state per request and append the tokens they sample themselves, so the driver never sends sampled tokens back.

    driver                                    every worker rank
    schedule() ──── SchedulerOutput ────────► execute_model()
    update_from_output() ◄── ModelRunnerOutput (rank 0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.lora import LoRAAdapter
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when a preempted request resumes
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hit or shared blocks)
    sample_seed: int | None = None  # seed of this sequence's generator (a child of n > 1 gets seed + index)
    lora_slot: int = -1  # the GPU slot of its LoRA adapter (-1: the base model); fixed while it runs


@dataclass
class CachedRequestData:
    """A request the workers already hold: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]  # appended to the block table (after its first num_kept_blocks)...
    num_computed_tokens: int  # before this step's tokens, counting the drafts of a step in flight as accepted
    replaces_block_ids: bool = False  # ...or, after a copy-on-write, the whole new table
    # How many blocks of the table stay (None: all): those past them were given back for a verify step's rejected
    # drafts (BlockManager.shrink), which the workers learn here, in the first step scheduled after the shrink.
    num_kept_blocks: int | None = None


@dataclass
class GrammarBitmask:
    """The allowed next tokens of some requests, packed as xgrammar packs them: token t is allowed for req_ids[i]
    when bit t % 32 of bitmask[i, t // 32] is 1. A numpy array: the contract carries no tensors. A request with d
    drafts in the step (speculative decoding) has 1 + d consecutive rows: the masks after 0, 1, ..., d of them."""

    req_ids: list[str]
    bitmask: np.ndarray  # int32 [len(req_ids), ceil(vocab_size / 32)]


DEVICE_DRAFT = -1  # a draft position whose token the workers propose on the device


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens to compute this step
    finished_req_ids: list[str] = field(default_factory=list)  # drop from the persistent batch (finished, aborted)
    preempted_req_ids: list[str] = field(default_factory=list)  # drop too; they come back as new requests
    # The KV moves each rank makes before the step's forward: computed blocks written to the host tier (device
    # block, host block), copy-on-write (src, dst), prefixes found on the host brought back (host block, device
    # block). The block manager guarantees that a device block a step offloads is not one that step writes, and a
    # host block a step offloads to is not one that step onloads from: offloads may run on a stream of their own,
    # beside the step, as long as the next step waits for them before it writes.
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_onloads: list[tuple[int, int]] = field(default_factory=list)
    # The allowed tokens of the constrained requests that sample in this step, when the driver knows them at launch
    # (None: no constraint, or the executor awaits them after launch: engine/executor.py, deferred sampling).
    grammar_bitmask: GrammarBitmask | None = None
    # LoRA adapters each rank loads into their slots before the step's forward (slot, adapter): the slot's previous
    # adapter is used by no request of this step (engine/lora.py LoRASlots).
    lora_loads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)
    # The workers' host-memory adapter cache, as the driver decides it (engine/lora.py LoRAHostCache), applied before
    # the loads: adapters dropped from it (ids), then adapters to read into it in the background (read id, adapter),
    # each reported done through Executor.take_lora_reads.
    lora_evictions: list[int] = field(default_factory=list)
    lora_reads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)
    # Speculative decoding: the draft tokens a request runs after its last token (vLLM's scheduled_spec_decode_tokens);
    # its num_scheduled_tokens counts them. The runner scores them and keeps those the target agrees with. A step's
    # drafts are all tokens, or all DEVICE_DRAFT: positions the workers fill on the device (kernels/ngram.py),
    # in a step launched before the one in flight is read back.
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def is_decode_only(self) -> bool:
        """Every scheduled request computes its last token and its drafts, no prompt chunk (a graphed step)."""
        return bool(self.num_scheduled_tokens) and all(
            n == 1 + len(self.scheduled_spec_token_ids.get(r, ())) for r, n in self.num_scheduled_tokens.items())


@dataclass
class Logprobs:
    """Log-probabilities of one sampled token and the top-k alternatives (from the raw logits)."""

    sampled_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PromptLogprobs:
    """One prefill chunk's prompt logprobs: prompt tokens [start, start + len(token_logprobs)) of a request, each
    scored from the hidden state of the token before it (so start >= 1), with the top-k alternatives."""

    start: int
    token_logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class ModelRunnerOutput:
    """What one step produced: one sampled token for each request whose scheduled tokens reached its end, and the
    prompt logprobs of the prompt chunks it computed for requests that asked for them."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] = field(default_factory=list)  # parallel to req_ids
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # req_id -> this step's chunk
    # Speculative decoding: the drafts each speculating request accepted, which come before its sampled token
    # (req_id -> tokens, and their logprobs where asked); the rest of its drafts were rejected.
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_draft_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)
    # DEVICE_DRAFT positions: how many drafts the workers' lookup found for each request (the positions past them
    # were rejected unscored), so that the draft counters count proposed drafts as the driver's proposals do
    draft_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class DraftAsk:
    """The driver's ask to a draft model on the workers (speculative decoding, method "draft_model"), before a step:
    for each running decode request, how many tokens it knows (the worker's copy must hold as many: it catches up
    on those its draft has not seen) and how many drafts it may take. The answer: req id -> its drafts (possibly
    fewer, or none)."""

    num_tokens: dict[str, int] = field(default_factory=dict)
    max_drafts: dict[str, int] = field(default_factory=dict)
