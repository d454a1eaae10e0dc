"""The OpenAPI document the ingress serves at /openapi.json: the real request models of cluster/protocol.py and
the shapes of every response, so that clients (and schemathesis, in CI) can check the server against it.

The routes read their bodies themselves (a size limit before parsing), so FastAPI cannot see the request models;
`openapi_schema` adds them, with the response models below, to what FastAPI generates.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cluster.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from cluster.schema_rules import ModelFacts, add_rules


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None  # OpenAI's: e.g. "model_not_found", else null


class ErrorResponse(BaseModel):
    error: ErrorDetail
    request_id: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # null unless asked for (vLLM's)
    prompt_token_ids: list[int] | None = None  # with return_token_ids (a stream: in a choice's first chunk)
    token_ids: list[int] | None = None  # with return_token_ids: the choice's (a chunk's new) tokens


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None  # a chat with tools (parsed per tool_choice)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # null unless asked for (vLLM's)
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in a call's first chunk
    arguments: str  # appended to the call's arguments


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None  # in a call's first chunk
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's new tokens


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion (the last before [DONE] may be an ErrorResponse)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, in each choice's first chunk


class CompletionChunk(Completion):
    """One `data:` event of a streamed completion (the last before [DONE] may be an ErrorResponse): a completion
    whose choices carry only what is new."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # a LoRA adapter's: its path
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's configuration (its tokenizer_config.json's fields, less paths)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    chat_template: str | None = None
    eos_token: str | None = None
    bos_token: str | None = None


class ModelHealth(BaseModel):
    replicas: int
    healthy: int


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded"]
    models: dict[str, ModelHealth]


ERROR_STATUSES = (400, 401, 404, 405, 413, 429, 500, 503)
# path -> (method, request model, JSON response model, SSE event model)
ROUTES: dict[str, tuple[str, type[BaseModel] | None, type[BaseModel], type[BaseModel] | None]] = {
    "/v1/completions": ("post", CompletionRequest, Completion, CompletionChunk),
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    "/v1/models": ("get", None, ModelList, None),
    "/v1/models/{model}": ("get", None, ModelCard, None),
    "/tokenize": ("post", TokenizeRequest, TokenizeResponse, None),
    "/detokenize": ("post", DetokenizeRequest, DetokenizeResponse, None),
    "/tokenizer_info": ("get", None, TokenizerInfo, None),
    "/health": ("get", None, HealthResponse, None),
}


def _object_schemas(schema: dict) -> list[dict]:
    """A request's object schema, or each of its `oneOf` variants (/tokenize: a prompt, or messages)."""
    return [schema] if "properties" in schema else schema.get("oneOf", [])


def openapi_schema(base: dict[str, Any], model_names: list[str],
                   facts: dict[str, ModelFacts] | None = None) -> dict[str, Any]:
    """FastAPI's document (`base`) with the request bodies and the responses of ROUTES filled in; a request's
    `model` is one of the served names (or left out, when one model is served), and what the served models
    (`facts`) and the edge's cross-field checks accept (cluster/schema_rules.py)."""
    components = base.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel]) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = ref(ErrorResponse)
    for path, (method, request, response, event) in ROUTES.items():
        operation = base.setdefault("paths", {}).setdefault(path, {}).setdefault(method, {})
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(request)}}}
            served = {"type": "string", "enum": list(model_names)}
            if len(model_names) == 1:  # else a request names its model
                served = {"anyOf": [served, {"type": "null"}], "default": None}
            for variant in _object_schemas(components[request.__name__]):
                variant["properties"]["model"] = served
        for parameter in operation.get("parameters", []):
            if parameter["name"] == "model":  # a path's or the query's: one of the served names
                parameter["schema"] = {"type": "string", "enum": list(model_names)}
                parameter["required"] = parameter["in"] == "path" or len(model_names) > 1
        ok = {"application/json": {"schema": ref(response)}}
        if event is not None:  # each SSE event: a chunk (or, last, an error) as JSON, then `data: [DONE]`
            payload = {"anyOf": [ref(event), error]}
            ok["text/event-stream"] = {"schema": {
                "type": "object", "required": ["data"], "description": f"{event.__name__} events, then [DONE]",
                "properties": {"data": {"anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}}
        operation["responses"] = {"200": {"description": "OK", "content": ok}} | {
            str(code): {"description": "error", "content": {"application/json": {"schema": error}}}
            for code in ERROR_STATUSES}
    add_rules(components, list(model_names), facts or {})
    return base
