"""The two wire formats of the serving path.

    client ──OpenAI JSON (pydantic models below)──► Ingress ──GenerateRequest──► LLMServer replica
    client ◄──OpenAI JSON / SSE (ingress builds)─── Ingress ◄──StepDelta (per step)── LLMServer replica

HTTP bodies are validated by pydantic at the edge; what crosses the Serve boundary is plain dataclasses (picklable,
no FastAPI objects). A `StepDelta` carries only what is new since the previous one, never the cumulative output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import ErrorInfo, InvalidRequestError, param_from_message
from engine.sampling_params import SamplingParams


# ---- replica wire format -------------------------------------------------------------------------------------------
@dataclass
class GenerateRequest:
    """One prompt for one replica. `messages` (chat) are rendered with the model's chat template by the replica."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    stream: bool = True  # False: the replica yields the accepted delta, then one final delta
    echo: bool = False  # return the prompt text in the first delta
    routing_key: str = ""  # prompt text the router hashes for prefix-cache affinity (see cluster/router.py)


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the top-k alternatives, best first


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    num_tokens: int = 0  # new output tokens in this delta
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def merge(self, later: ChoiceDelta) -> None:
        """Appends a later delta of the same choice."""
        self.text += later.text
        self.num_tokens += later.num_tokens
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class StepDelta:
    """What a replica yields per engine step. The first one of a request is `accepted`: the prompt passed
    validation (prompt_tokens set, no choices yet); or it carries an `error` and is the last one."""

    replica: str
    prompt_tokens: int = 0
    choices: list[ChoiceDelta] = field(default_factory=list)
    finished: bool = False
    accepted: bool = False
    prompt_text: str | None = None
    error: ErrorInfo | None = None


# ---- OpenAI request bodies -----------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI-compatible servers do

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None

    def _sampling_kwargs(self) -> dict[str, Any]:
        chosen = {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                  "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                  "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                  "include_stop_str_in_output": self.include_stop_str_in_output,
                  "skip_special_tokens": self.skip_special_tokens, "logit_bias": self._logit_bias()}
        return {k: v for k, v in chosen.items() if v is not None}

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The batch: a string, a list of strings, a list of token ids or a list of lists of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must equal n)", "best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported (no prompt logprobs)", "echo")
        return _make_params(max_tokens=self.max_tokens, logprobs=self.logprobs, **self._sampling_kwargs())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template unchanged

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("only response_format type 'text' is supported", "response_format")
        if self.tools:
            raise InvalidRequestError("tools are not supported", "tools")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return _make_params(max_tokens=max_tokens, logprobs=logprobs, **self._sampling_kwargs())

    def message_dicts(self) -> list[dict]:
        return message_dicts(self.messages)

    def routing_key(self) -> str:
        return "".join(f"<{m.role}>{m.content if isinstance(m.content, str) else ''}" for m in self.messages)

    def param_name(self, engine_param: str | None) -> str | None:
        """The engine names its own fields; name the one this client sent."""
        if engine_param == "logprobs" and self.top_logprobs is not None:
            return "top_logprobs"
        if engine_param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if engine_param == "prompt":
            return "messages"
        return engine_param


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template expects them: text parts joined into one string."""
    out = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            for part in message.content:
                if part.type != "text":
                    raise InvalidRequestError(f"content part type {part.type!r} is not supported", "messages")
            entry["content"] = "".join(part.text or "" for part in message.content)
        elif message.content is None:
            entry["content"] = ""
        out.append(entry)
    return out


def _make_params(**kwargs) -> SamplingParams:
    """SamplingParams validates itself; its ValueError names the field (mapped to `param` by cluster/errors)."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise InvalidRequestError(str(e), param_from_message(str(e))) from e
    except TypeError as e:
        raise InvalidRequestError(str(e)) from e




# ---- OpenAI response pieces ----------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(logprobs: list[TokenLogprob], text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, `text_offset` from the start of the choice's text."""
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [dict(lp.top) or {lp.token: lp.logprob} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top]}
                        for lp in logprobs]}
