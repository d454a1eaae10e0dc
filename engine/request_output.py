"""What users get back: one `RequestOutput` per request, with one `CompletionOutput` per completion (n)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative; while unfinished, without a tail that a stop string could still cut away
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token: sampled id and the top-k ids -> log-probability
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed the request
    # With SamplingParams.prompt_logprobs (vLLM's shape): per prompt token, its id and the top-k ids ->
    # log-probability; None for the first token. In delta outputs, only the first output carries it.
    prompt_logprobs: list[dict[int, float] | None] | None = None
