"""What the engine reports about a request: `RequestDelta`s, the one representation of progress from the engine
step to the HTTP socket.

    engine step ──RequestDelta (new tokens, text, logprobs, finish)──► engine actor's outbox ──poll (a batch)──►
    replica ──forwarded as is──► ingress ──► one SSE chunk per delta, or the response of the final one

A delta carries only what is new since the request's previous delta. A request that does not stream gets a single
delta, its last, which then holds the whole output. The offline `LLM` builds the vLLM-style cumulative
`RequestOutput` from that last delta (`RequestOutput.from_final_delta`); nothing on the serving path rebuilds
cumulative outputs or diffs them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from engine.errors import ParamError


@dataclass
class TokenLogprob:
    """One token: its log-probability and the top alternatives (best first), with the strings the API shows for
    them. `logprob` is None only for a prompt's first token, which nothing predicts."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token id, token string, logprob)


@dataclass
class SequenceDelta:
    """What one of the request's n sequences produced since the last delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one entry per new token, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; set once, on its last delta
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestMetrics:
    """Engine-side timestamps (time.time(), so that another process on the node can compare them) and counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    @property
    def queue_time_s(self) -> float | None:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time_s(self) -> float | None:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time_s(self) -> float | None:
        return _span(self.first_token_time, self.finish_time)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(end - start, 0.0)


@dataclass
class RequestError:
    """Why the engine failed a request, on its last delta: what the HTTP edge answers is read off `kind`
    (cluster/request_run.py), never parsed out of the message.

        kind         when                                                 at the edge
        INVALID      the request cannot be served as written: a grammar   400 naming `param` (the field as the
                     that its compiler refuses                            engine names it)
        UNAVAILABLE  not now: its grammar did not compile in time (the    503; the same request may pass later
                     compilation goes on into the cache)
        INTERNAL     the engine's fault: a failed step, a dead loop, a    500, its reason in the log
                     grammar that rejected a sampled token
    """

    INVALID: ClassVar[str] = "invalid"
    UNAVAILABLE: ClassVar[str] = "unavailable"
    INTERNAL: ClassVar[str] = "internal"

    message: str
    kind: str = INTERNAL
    param: str | None = None  # INVALID: the request's field at fault, where one is

    def __post_init__(self):
        assert self.kind in (self.INVALID, self.UNAVAILABLE, self.INTERNAL), f"unknown request error kind {self.kind}"

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_exception(cls, e: BaseException) -> RequestError:
        """A ParamError is the request's fault (INVALID, naming its field); anything else the engine's."""
        if isinstance(e, ParamError):
            return cls(str(e), cls.INVALID, e.param)
        return cls(f"{type(e).__name__}: {e}")


@dataclass
class RequestDelta:
    request_id: str
    seqs: list[SequenceDelta] = field(default_factory=list)  # the sequences that moved
    finished: bool = False
    error: RequestError | None = None  # the engine failed the request (it is finished)
    metrics: RequestMetrics | None = None  # on the last delta
    # With SamplingParams.prompt_logprobs, on the request's first delta: one entry per prompt token (the first's
    # logprob None: nothing predicts it), its top alternatives among `top`.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def num_new_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


# ---- the offline API's cumulative shape (vLLM's) --------------------------------------------------------------------
@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token: the sampled id and the top-k ids -> log-probability
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: RequestError | None = None  # str(error) is its message
    # With SamplingParams.prompt_logprobs (vLLM's shape): per prompt token, its id and the top-k ids ->
    # log-probability; None for the first token.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def from_final_delta(cls, delta: RequestDelta, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        """A request's whole output from the only delta of a request that did not stream."""
        outputs = []
        for seq in sorted(delta.seqs, key=lambda s: s.index):
            logprobs: list[dict[int, float]] | None = None
            cumulative: float | None = None
            if seq.logprobs is not None:
                logprobs, cumulative = [], 0.0
                for entry in seq.logprobs:
                    assert entry.logprob is not None, f"{delta.request_id}: a generated token without its logprob"
                    logprobs.append({t: lp for t, _, lp in entry.top} | {entry.token_id: entry.logprob})
                    cumulative += entry.logprob
            outputs.append(CompletionOutput(seq.index, seq.text, list(seq.token_ids), logprobs, seq.finish_reason,
                                            seq.stop_reason, cumulative))
        prompt_logprobs = None if delta.prompt_logprobs is None else [
            None if entry.logprob is None else {t: lp for t, _, lp in entry.top} | {entry.token_id: entry.logprob}
            for entry in delta.prompt_logprobs]
        return cls(delta.request_id, prompt, prompt_token_ids, outputs, delta.finished, delta.metrics, delta.error,
                   prompt_logprobs)
