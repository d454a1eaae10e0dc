"""The serving path's wire formats.

    client ──OpenAI JSON (the pydantic request models below)──► Ingress ──GenerateRequest──► LLMServer replica
    client ◄──OpenAI JSON / SSE (ingress builds them) ◄─ Ingress ◄── Accepted, then list[RequestDelta] ── replica

HTTP bodies are validated at the edge, strictly (no coercion: `echo: 0` or a boolean token id is a 400) and
completely (a field Pagoda does not implement is a 400 naming it). Between the deployments only plain dataclasses
cross: the engine's own `RequestDelta`s (engine/request_output.py), forwarded as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Annotated

from cluster.errors import ErrorInfo, InvalidRequestError
from cluster.tool_choice import tool_choice_constraint
from engine.errors import ParamError
from engine.lora import LoRARequest
from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRINGS,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
)
from engine.structured_outputs import StructuredOutputsParams

_INT32 = 2**31 - 1


def _whole_numbers(value):
    """JSON's 2.0 is the number 2, an integer (as a JSON schema's "integer" reads it): whole floats become ints,
    throughout a body, before strict validation (which still refuses "2" and true)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {key: _whole_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(item) for item in value]
    return value


_TOKEN_ID_KEY = re.compile(r"(0|[1-9][0-9]{0,9})\Z")


def _token_id(value: int) -> int:
    if not 0 <= value <= _INT32:
        raise PydanticCustomError("token_id", "token ids must be integers >= 0 (and at most {max}), got {value}",
                                  {"max": _INT32, "value": value})
    return value


# The vocabulary bounds them too: the replica checks that; /openapi.json says it (cluster/openapi.py).
TokenId = Annotated[int, AfterValidator(_token_id), WithJsonSchema({"type": "integer", "minimum": 0,
                                                                    "maximum": _INT32})]


def _truncation(value: int) -> int:
    if not (value == -1 or 1 <= value <= _INT32):
        raise PydanticCustomError("truncate_prompt_tokens", "must be -1 (as many tokens as the context holds) or "
                                  "a number of tokens from 1 to {max}, got {value}", {"max": _INT32, "value": value})
    return value


TruncatePromptTokens = Annotated[int, AfterValidator(_truncation), WithJsonSchema(
    {"anyOf": [{"type": "integer", "const": -1}, {"type": "integer", "minimum": 1, "maximum": _INT32}]})]
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
    tools: list[dict] | None = None  # the chat template's `tools` (OpenAI's function tools)
    continue_final_message: bool = False  # the chat's last message is left open for the model to continue
    stream: bool = True  # False: the replica yields Accepted, then one list holding the final delta
    echo: bool = False  # return the prompt text in Accepted
    return_token_ids: bool = False  # return the prompt's token ids in Accepted
    routing_key: str = ""  # prompt text the router hashes for prefix-cache affinity (see cluster/router.py)
    arrival_time: float | None = None  # time.time() when the ingress received the request (TTFT, E2E)
    lora_request: LoRARequest | None = None  # the adapter the `model` field named (None: the base model)


@dataclass
class TokenizeInput:
    """What /tokenize asks of a replica: a prompt, or messages to render as a chat would be."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


@dataclass
class Accepted:
    """A replica's first answer: the prompt passed validation (else it answers an ErrorInfo and stops)."""

    replica: str
    num_prompt_tokens: int
    prompt_text: str | None = None  # with echo
    prompt_token_ids: list[int] | None = None  # with return_token_ids


# ---- OpenAI request bodies -----------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class _Body(_Strict):
    """A request body: its whole floats are integers (_whole_numbers), once, at its root."""

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data):
        return _whole_numbers(data)


NonEmptyStr = Annotated[str, Field(min_length=1)]
T = TypeVar("T")
NonEmptyList = Annotated[list[T], Field(min_length=1)]
# The structured-output kinds of vLLM's structured_outputs (engine/structured_outputs.py's KINDS), field name first.
_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _exactly_one_kind(schema: dict[str, Any]) -> None:
    """The JSON schema of StructuredOutputs says that exactly one kind is set (json_object: to true), and that
    any_whitespace goes with json and json_object only."""
    variants = []
    for kind in _OUTPUT_KINDS:
        properties = {other: {"enum": [None, False]} if other == "json_object" else {"type": "null"}
                      for other in _OUTPUT_KINDS if other != kind}
        properties[kind] = {"const": True} if kind == "json_object" else {"not": {"type": "null"}}
        if kind not in ("json", "json_object"):
            properties["any_whitespace"] = {"const": False}
        variants.append({"required": [kind], "properties": properties})
    schema["oneOf"] = variants


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one constraint (engine/structured_outputs.py compiles it)."""

    model_config = ConfigDict(json_schema_extra=_exactly_one_kind)

    json_: str | dict[str, Any] | None = Field(None, alias="json")  # a JSON schema (or its text)
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None  # EBNF (GBNF), rule `root`
    json_object: bool | None = None  # true: any JSON object
    any_whitespace: bool = False  # json / json_object: whitespace allowed between tokens

    def to_value(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump(by_alias=True).items() if v is not None}


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(_Body):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extras (structured outputs: one of
    response_format, vLLM's structured_outputs or its older guided_* fields)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=1e4)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=_INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    seed: int | None = Field(None, ge=-MAX_SEED, le=MAX_SEED)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's: json | regex | choice | grammar | json_object
    guided_json: str | dict[str, Any] | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None
    # vLLM's extras
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)  # only these may be sampled
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # keep the prompt's last k tokens (-1: what fits)
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the answer (RL frameworks read them)
    use_beam_search: Annotated[bool, WithJsonSchema({"const": False})] = False  # Pagoda does no beam search

    def _sampling_kwargs(self, defaults: dict[str, Any] | None, **overrides) -> dict[str, Any]:
        """The model's defaults (its generation_config.json), then the fields the request shares with
        SamplingParams (by name) that it set, then `overrides` as given."""
        chosen = {name: getattr(self, name) for name in self.model_fields_set & _SAMPLING_FIELDS}
        chosen |= {"n": self.n, "min_tokens": self.min_tokens, "logit_bias": self._logit_bias(),
                   "structured_outputs": self._constraint()}
        return dict(defaults or {}) | {k: v for k, v in chosen.items() if v is not None} | overrides

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        if not all(_TOKEN_ID_KEY.match(token) for token in self.logit_bias):  # int() takes " 7", "+7" and "7_0"
            raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)", "logit_bias")
        return {int(token): bias for token, bias in self.logit_bias.items()}

    def _constraint(self) -> StructuredOutputsParams | None:
        return output_constraint(self)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats` (with include_usage): every chunk carries the usage so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", "stream_options")
        if self.use_beam_search:
            raise InvalidRequestError("beam search is not supported (Pagoda samples; n gives several samples)",
                                      "use_beam_search")


class CompletionRequest(_Request):
    prompt: str | NonEmptyList[TokenId] | NonEmptyList[str] | NonEmptyList[NonEmptyList[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the prompt tokens' logprobs
    echo: bool = False
    best_of: Annotated[int, WithJsonSchema({"const": 1})] | None = None  # 1 with n 1: Pagoda ranks no samples
    suffix: Annotated[str, WithJsonSchema({"type": "string", "maxLength": 0})] | None = None  # not supported

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
        self.check_options()
        if self.best_of is not None and (self.best_of, self.n) != (1, 1):
            raise InvalidRequestError("best_of is not supported: Pagoda does not rank samples (best_of may be 1, "
                                      "with n 1)", "best_of")
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


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool's answer: to which call
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    refusal: str | None = None  # as OpenAI's client sends an earlier answer back


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # the schema is always enforced where a call is constrained


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the rendered prompt's logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model continues the last message (a prefilled answer)
    echo: bool = False  # vLLM's: the answer starts with the last message where it continues it (see echo_text)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # none given: auto with tools
    parallel_tool_calls: bool = True

    def to_sampling_params(self, default_max_tokens: int | None = None,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        self.check_options()
        generation_prompt(self)  # continue_final_message with add_generation_prompt: a 400
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs is not supported with stream=true in chat", "prompt_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        try:
            return make_params(self._sampling_kwargs(defaults, max_tokens=max_tokens, logprobs=logprobs,
                                                     prompt_logprobs=self.prompt_logprobs))
        except InvalidRequestError as e:
            raise e.renamed(self.param_name(e.param)) from None

    def _constraint(self) -> StructuredOutputsParams | None:
        if self.tool_choice is not None and not self.tools:
            raise InvalidRequestError("tool_choice is only allowed when tools are given", "tool_choice")
        if not self.parallel_tool_calls and self.tool_choice_value == "auto":
            raise InvalidRequestError("parallel_tool_calls=false is enforced only with tool_choice 'required' or a "
                                      "named function (with 'auto' the model's own format decides)",
                                      "parallel_tool_calls")
        return output_constraint(self, tool_choice_constraint(self.tool_dicts(), self.tool_choice_value,
                                                              self.parallel_tool_calls))

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools is not None else None

    @property
    def tool_choice_value(self) -> str | dict:
        """tool_choice as OpenAI reads it: 'auto' when tools are given without one, else 'none'."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or ("auto" if self.tools else "none")

    def message_dicts(self) -> list[dict]:
        return message_dicts(self.messages)

    @property
    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's text, where the answer is that message's role's (an assistant's
        after a generation prompt; without one, whatever the last message's role), else nothing."""
        last = self.messages[-1]
        if not self.echo or (generation_prompt(self) and last.role != "assistant"):
            return ""
        return message_dicts([last])[0]["content"]

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


def _one_of_prompt_or_messages(schema: dict[str, Any]) -> None:
    """/tokenize's JSON schema says what it takes: a prompt, or messages with the chat's own fields."""
    properties = schema.pop("properties")
    for name in ("prompt", "messages", "add_special_tokens"):
        properties[name].pop("default", None)
    chat_only = {"messages", *_CHAT_TOKENIZE_FIELDS}
    schema.pop("additionalProperties", None)
    schema["oneOf"] = [
        {"type": "object", "required": ["prompt"], "additionalProperties": False,
         "properties": {k: v for k, v in properties.items() if k not in chat_only}},
        {"type": "object", "required": ["messages"], "additionalProperties": False,
         "properties": {k: v for k, v in properties.items() if k != "prompt"}, **_CONTINUE_NOT_WITH_GENERATION}]


_CHAT_TOKENIZE_FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")
# continue_final_message continues the last message: a generation prompt after it is not asked for at once
_CONTINUE_NOT_WITH_GENERATION = {
    "if": {"properties": {"continue_final_message": {"const": True}}, "required": ["continue_final_message"]},
    "then": {"properties": {"add_generation_prompt": {"const": False}}}}


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template as a chat would be
    (exactly one of them; the chat's own fields only with messages)."""

    model_config = ConfigDict(json_schema_extra=_one_of_prompt_or_messages)

    model: str | None = None
    prompt: str = None  # no null: the request gives a prompt or messages
    messages: list[ChatMessage] = Field(None, min_length=1)
    add_special_tokens: bool = None  # default: True for a prompt; for messages False (their template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # also each token's string (the tokenizer's spelling)

    def to_input(self) -> TokenizeInput:
        given = [name for name in ("prompt", "messages") if name in self.model_fields_set]
        if len(given) != 1:
            raise InvalidRequestError("give either prompt or messages, not both" if given else
                                      "prompt or messages is required", "prompt")
        if self.prompt is not None:
            for name in _CHAT_TOKENIZE_FIELDS:
                if name in self.model_fields_set:
                    raise InvalidRequestError(f"{name} applies to messages, not to a prompt", name)
            return TokenizeInput(prompt=self.prompt, add_special_tokens=self.add_special_tokens is not False,
                                 return_token_strs=self.return_token_strs)
        return TokenizeInput(messages=message_dicts(self.messages), add_special_tokens=bool(self.add_special_tokens),
                             add_generation_prompt=generation_prompt(self),
                             continue_final_message=self.continue_final_message,
                             tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
                             chat_template_kwargs=self.chat_template_kwargs, return_token_strs=self.return_token_strs)


def generation_prompt(req: TokenizeRequest | ChatCompletionRequest) -> bool:
    """add_generation_prompt as the template gets it: off with continue_final_message, unless the client set both
    (a 400: the final message cannot be continued and a new one started at once)."""
    if not req.continue_final_message:
        return req.add_generation_prompt
    if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                  "continue_final_message")
    return False


class LoadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter body; base_model_name (Pagoda's) picks the model when several take
    adapters."""

    lora_name: NonEmptyStr
    lora_path: NonEmptyStr
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(_Body):
    lora_name: NonEmptyStr
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates expect them: text parts joined into one string, a tool call's arguments as the
    object they encode (templates write them with `tojson`)."""
    out = []
    for i, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        entry.pop("refusal", None)
        if isinstance(message.content, list):
            entry["content"] = "".join(part.text for part in message.content)
        elif message.content is None:
            entry["content"] = ""
        for j, call in enumerate(entry.get("tool_calls", [])):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                raise InvalidRequestError("is not JSON", f"messages[{i}].tool_calls[{j}].function.arguments") from None
        out.append(entry)
    return out


def output_constraint(req: _Request, tool_constraint: StructuredOutputsParams | None = None,
                      ) -> StructuredOutputsParams | None:
    """The request's structured-output constraint, from whichever field gives it (at most one may); errors name
    that field as the client wrote it."""
    given = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = ("response_format", {"json_object": True})
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequestError("response_format.json_schema is required with type 'json_schema'",
                                      "response_format.json_schema")
        schema = fmt.json_schema.schema_
        given["response_format"] = ("response_format.json_schema.schema",
                                    {"json": schema} if schema is not None else {"json_object": True})
    if req.structured_outputs is not None:
        given["structured_outputs"] = (None, req.structured_outputs.to_value())
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            given[f"guided_{kind}"] = (f"guided_{kind}", {kind: value})
    if tool_constraint is not None:
        given["tool_choice"] = (None, tool_constraint)
    if len(given) > 1:
        raise InvalidRequestError(f"only one of {', '.join(given)} may constrain the output", list(given)[1])
    if not given:
        return None
    param, value = next(iter(given.values()))
    if isinstance(value, dict) and isinstance(value.get("grammar"), str) and _is_lark(value["grammar"]):
        raise InvalidRequestError("is a Lark grammar, which Pagoda does not support: give EBNF (GBNF, rules as "
                                  "`name ::= ...`, starting at `root`)", param or "structured_outputs.grammar")
    try:
        return StructuredOutputsParams.from_value(value)
    except ParamError as e:
        raise (e.renamed(param) if param else e) from None


_LARK_RULE = re.compile(r"^\s*(%(import|ignore|declare)\b|[?!]?[A-Za-z_][\w.]*\s*:(?!:=))", re.MULTILINE)


def _is_lark(grammar: str) -> bool:
    """Lark's syntax (vLLM's guidance backend takes it) rather than EBNF: `rule: ...` or %-directives, no `::=`."""
    return "::=" not in grammar and bool(_LARK_RULE.search(grammar))


def make_params(kwargs: dict[str, Any]) -> SamplingParams:
    """SamplingParams validates itself; its ParamError names the field."""
    try:
        return SamplingParams(**kwargs)
    except ParamError as e:
        raise InvalidRequestError(str(e), e.param) from e


def error_info(e: ParamError) -> ErrorInfo:
    return ErrorInfo(400, str(e), e.param)
