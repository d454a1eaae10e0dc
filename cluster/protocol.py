"""The serving path's wire formats.

    client ──OpenAI JSON (the pydantic request models below)──► Ingress ──GenerateRequest──► LLMServer replica
    client ◄──OpenAI JSON / SSE (ingress builds them) ◄─ Ingress ◄── Accepted, then list[RequestDelta] ── replica

HTTP bodies are validated at the edge, strictly (no coercion: `echo: 0` or a boolean token id is a 400) and
completely (a field Pagoda does not implement is a 400 naming it). Between the deployments only plain dataclasses
cross: the engine's own `RequestDelta`s (engine/request_output.py), forwarded as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

from cluster.errors import ErrorInfo, InvalidRequestError
from engine.errors import ParamError
from engine.request_output import TokenLogprob
from engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_STOP_STRINGS, SamplingParams

_INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT32)]
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


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
    stream: bool = True  # False: the replica yields Accepted, then one list holding the final delta
    echo: bool = False  # return the prompt text in Accepted
    routing_key: str = ""  # prompt text the router hashes for prefix-cache affinity (see cluster/router.py)
    arrival_time: float | None = None  # time.time() when the ingress received the request (TTFT, E2E)


@dataclass
class Accepted:
    """A replica's first answer: the prompt passed validation (else it answers an ErrorInfo and stops)."""

    replica: str
    num_prompt_tokens: int
    prompt_text: str | None = None  # with echo


# ---- OpenAI request bodies -----------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(_Strict):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=1e4)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=_INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=1e4)
    seed: int | None = Field(None, ge=-MAX_SEED, le=MAX_SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    max_tokens: int | None = Field(None, ge=1, le=_INT32)
    min_tokens: int = Field(0, ge=0, le=_INT32)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None  # OpenAI's: no effect by nature, so accepted
    metadata: dict[str, str] | None = None  # likewise

    def _sampling_kwargs(self, defaults: dict[str, Any] | None, **overrides) -> dict[str, Any]:
        """The model's defaults (its generation_config.json), then the fields the request shares with
        SamplingParams (by name) that it set, then `overrides` as given."""
        chosen = {name: getattr(self, name) for name in self.model_fields_set & _SAMPLING_FIELDS}
        chosen |= {"n": self.n, "min_tokens": self.min_tokens, "logit_bias": self._logit_bias()}
        return dict(defaults or {}) | {k: v for k, v in chosen.items() if v is not None} | overrides

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

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", "stream_options")


class CompletionRequest(_Request):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the prompt tokens' logprobs
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

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        self.check_stream_options()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must equal n)", "best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        return make_params(self._sampling_kwargs(defaults, max_tokens=self.max_tokens, logprobs=self.logprobs,
                                                 prompt_logprobs=self.prompt_logprobs_wanted))

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """echo with logprobs shows the prompt's logprobs too (the evaluation harnesses' loglikelihood)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the rendered prompt's logprobs
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def to_sampling_params(self, default_max_tokens: int | None = None,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        self.check_stream_options()
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs is not supported with stream=true in chat", "prompt_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("only response_format type 'text' is supported", "response_format")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        try:
            return make_params(self._sampling_kwargs(defaults, max_tokens=max_tokens, logprobs=logprobs,
                                                     prompt_logprobs=self.prompt_logprobs))
        except InvalidRequestError as e:
            e.param = self.param_name(e.param)
            raise

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


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template expects them: text parts joined into one string."""
    out = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            entry["content"] = "".join(part.text for part in message.content)
        elif message.content is None:
            entry["content"] = ""
        out.append(entry)
    return out


def make_params(kwargs: dict[str, Any]) -> SamplingParams:
    """SamplingParams validates itself; its ParamError names the field."""
    try:
        return SamplingParams(**kwargs)
    except ParamError as e:
        raise InvalidRequestError(str(e), e.param) from e


# ---- OpenAI response pieces ----------------------------------------------------------------------------------------
def error_info(e: ParamError) -> ErrorInfo:
    return ErrorInfo(400, str(e), e.param)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(logprobs: list[TokenLogprob], text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, `text_offset` from the start of the choice's text. An echoed
    prompt's first token has no logprob (None), as in OpenAI's and vLLM's answers."""
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp.logprob is None else ({t: v for _, t, v in lp.top} or {lp.token: lp.logprob})
                             for lp in logprobs],
            "text_offset": offsets}


def prompt_logprobs_json(entries: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id -> logprob, rank among the
    alternatives shown (None if it is not among them) and text."""
    out = []
    for entry in entries:
        if entry.logprob is None:
            out.append(None)
            continue
        ranks = {t: rank for rank, (t, _, _) in enumerate(entry.top, start=1)}
        item = {str(t): {"logprob": v, "rank": ranks[t], "decoded_token": text} for t, text, v in entry.top}
        item.setdefault(str(entry.token_id), {"logprob": entry.logprob, "rank": ranks.get(entry.token_id),
                                              "decoded_token": entry.token})
        out.append(item)
    return out


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                          for _, t, v in lp.top]}
                        for lp in logprobs]}
