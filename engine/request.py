"""A request's state on the driver: one number line of prompt + output tokens, `num_computed_tokens` of them in the
KV cache.

    prompt tokens                 output tokens
    |=========================|==========|
    |<-- num_computed_tokens -->|           chunked prefill, prefix-cache hits and recompute after preemption
                                            all move this one number forward
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import Logprobs, PromptLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import RequestGrammar
    from engine.lora import LoRAAdapter


class RequestStatus(enum.IntEnum):
    """Ordered: every status at or above FINISHED_STOPPED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence. A user request with n > 1 becomes n of these: index 0 leads, the others wait for the leader's
    prompt to be in the cache and then share its blocks (see `BlockManager.admit`)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never past max_model_len
    parent_id: str = ""  # the user's request id; equals req_id when n == 1
    index: int = 0  # which of the n completions
    leader: Request | None = None  # for n > 1: the sequence whose prompt blocks this one shares
    sample_seed: int | None = None
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprobs | None] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token (as output_logprobs: the token's own logprob and the
    # top alternatives), None for the first (nothing predicts it) and until computed.
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0  # sampled by a launched step, not yet known here (overlapped scheduling)
    num_pending_drafts: int = 0  # drafts of launched steps not yet read back (computed counts them as accepted)
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    num_preempted_tokens: int = 0  # tokens computed when it was last preempted (what it may get back or recompute)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of this request's full blocks
    first_scheduled_time: float | None = None  # time.time() of its first step
    first_token_time: float | None = None
    is_suspect: bool = False  # in a step that failed: runs alone until it samples again (Scheduler.isolate)
    grammar: RequestGrammar | None = None  # structured outputs: this sequence's matcher (engine/grammar.py)
    lora: LoRAAdapter | None = None  # its LoRA adapter (None: the base model)
    lora_slot: int = -1  # the GPU slot its adapter is in while it runs (-1: none held)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for its next step (engine/spec_decode.py)
    num_step_tokens: int = 1  # tokens its last step appended (more than one with accepted drafts)

    def __post_init__(self):
        if not self.parent_id:
            self.parent_id = self.req_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Its tokens once the steps in flight are read back, if they accept every draft: what it has computed
        (num_computed_tokens) or can compute."""
        return self.num_tokens + self.num_pending_tokens + self.num_pending_drafts

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED  # hot: plain int comparison

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Stores a prefill chunk's prompt logprobs by position (a recompute after preemption rewrites the same)."""
        if not self.prompt_logprobs:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        for i, (logprob, ids, values) in enumerate(zip(chunk.token_logprobs, chunk.top_token_ids,
                                                       chunk.top_logprobs)):
            self.prompt_logprobs[chunk.start + i] = Logprobs(logprob, ids, values)

    def extend_output(self, token_ids: list[int], logprobs: list[Logprobs | None]) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_token_ids.extend(token_ids)
        self.output_logprobs.extend(logprobs)

    def append_output(self, token_id: int, logprobs: Logprobs | None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
