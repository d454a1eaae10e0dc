"""The OpenAI-compatible HTTP edge: a FastAPI app behind Ray Serve, CPU only, N replicas.

    POST /v1/completions, /v1/chat/completions   (SSE when stream=true)     GET /v1/models, /openapi.json
    POST /tokenize, /detokenize                   GET /health, /metrics      GET /debug/integrity (debug only)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (allow_runtime_lora_updating only)

Each request: authorize (Bearer key) → read the body (size limit, before parsing) → validate (strict pydantic) →
pick the model's LLMServer handle by `model` (a LoRA adapter's name picks its base model's, and the request carries
the adapter: cluster/lora_registry.py) → one streaming handle call per prompt → wait for every replica to
accept (or refuse) → answer: JSON built from each prompt's final delta, or SSE, one chunk per delta, whose status
is already known to be 200. A client that disconnects aborts its requests, streaming or not (the request's streams,
their retry after a lost replica, the disconnect watch and the SSE body: cluster/request_run.py). Any exception
becomes an OpenAI error JSON through cluster.errors.to_http_error, with the request id; every 5xx is logged.

Two Serve constraints shape this file: no `from __future__ import annotations` (class-based routes resolve the
`Request` annotation at run time; a string would become a query parameter, 422), and every module-level helper is
defined above the `Ingress` class (`serve.ingress` pickles the routes when the class is defined, with the globals
that exist at that moment).
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import errors
from cluster.errors import ErrorInfo
from cluster.lora_registry import LoRAConfig, LoRAModule, LoRARegistry
from cluster.metrics import merge_families
from cluster.openapi import openapi_schema
from cluster.protocol import (
    Accepted,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    generation_prompt,
)
from cluster.request_run import AcceptTimeout, Admission, RequestRun, is_replica_loss, sse_response, unless_disconnected
from cluster.responses import chat_body, chat_chunks, completion_body, completion_chunks
from cluster.schema_rules import ModelFacts
from cluster.tool_choice import tool_parser_for_choice
from engine.errors import shortened
from engine.lora import LoRARequest
from engine.structured_outputs import import_in_background

logger = logging.getLogger(__name__)

MODEL_INFO_TTL_S = 10.0  # a model's limits as the ingress keeps them: asked again when older

app = FastAPI(title="Pagoda", version="1", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException):
    error = errors.http_status_error(exc.status_code, f"{request.method} {shortened(request.url.path)}: {exc.detail}")
    return JSONResponse(errors.error_body(error, None), status_code=exc.status_code, headers=exc.headers)


@dataclass
class IngressConfig:
    api_key: str | None = None
    max_body_bytes: int = 10 * 1024 * 1024
    accept_timeout_s: float = 60.0  # waiting for a replica to accept a request (none ready: 503)
    control_timeout_s: float = 10.0  # broadcasts: /metrics, /debug/* (a replica silent this long is left out)
    health_timeout_s: float = 5.0  # /health: a replica that does not answer its check this long is unhealthy
    debug: bool = False  # enables /debug/integrity and /debug/fail_engine
    default_max_tokens: int | None = None  # chat without max_tokens: None = the rest of the context (OpenAI's)
    # served model name -> the most calls (one a prompt) its deployment admits at once from this ingress replica
    # (max_ongoing_requests x replicas + max_queued_requests; None: no limit): beyond them a 429; a completion batch
    # of more prompts is a 400, a 429 that no retry could pass
    max_prompts: dict[str, int | None] = field(default_factory=dict)
    # import xgrammar when the replica starts, not in the first constrained request (seconds that stall its streams)
    prepare_structured_outputs: bool = False
    lora: dict = field(default_factory=dict)  # LoRAConfig's fields (cluster/app.py _lora_config)


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: `name` (echoed in responses), the served model that runs it (`base`: its
    deployment's handle, limits and admission) and the adapter it runs with (None: the base model itself)."""

    name: str
    base: str
    handle: object
    lora: LoRARequest | None = None


def _error_response(exc: BaseException, request_id: str | None) -> Response:
    error = errors.to_http_error(exc)
    if error.status_code >= 500:
        logger.warning("request %s failed: %s", request_id, error.message)
    headers = {"X-Pagoda-Request-Id": request_id} if request_id else {}
    if isinstance(error, errors.TooManyRequestsError):
        headers["Retry-After"] = str(error.retry_after_s)
    return JSONResponse(errors.error_body(error, request_id), status_code=error.status_code, headers=headers)


def _request_id(request: Request) -> str:
    """Pagoda's request id is Serve's: the client's X-Request-Id where it sent one (vLLM adopts it too), else the id
    Serve (or HAProxy) gave the request. Serve returns it as the response's x-request-id, which the openai client
    reads as `_request_id`: that id is the one in the body's `request_id`, X-Pagoda-Request-Id and the logs (a
    completion's `id` is cmpl- or chatcmpl- and it)."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _engine_id(request_id: str) -> str:
    """The engine's id of a request: its request id and a nonce (two clients may send one X-Request-Id at once)."""
    return f"{request_id}.{uuid.uuid4().hex[:8]}"


def _check_length(info: dict, texts: list[str], param: str) -> None:
    """A prompt longer than any the model can hold is refused here, before it travels or is tokenized."""
    for text in texts:
        if len(text) > info["max_prompt_chars"]:
            raise errors.InvalidRequestError(f"{param} is {len(text)} characters, more than this model's context "
                                             f"can hold", param)


def _tool_parser(req: ChatCompletionRequest, info: dict):
    """What makes each choice's tool parser (None: no tools, or tool_choice 'none'). 'auto' reads the model's own
    format, which needs the server's tool-call parser (set, or known from the model's chat template)."""
    if not req.tools:
        return None
    choice, auto_parser = req.tool_choice_value, info["tool_call_parser"]
    if choice == "auto" and auto_parser is None:
        if req.tool_choice is None:
            return None  # OpenAI's default, where the server cannot read calls: the tools are only shown
        raise errors.InvalidRequestError("tool_choice 'auto' needs a tool-call parser: this model's chat template "
                                         "has no known tool-call format (start the server with --tool-call-parser)",
                                         "tool_choice")
    if tool_parser_for_choice(choice, auto_parser) is None:
        return None
    return lambda: tool_parser_for_choice(choice, auto_parser)


def _one_name_per_deployment(models: dict) -> list[str]:
    """The first served name of each deployment: aliases share one, and what is asked of every replica (/metrics)
    must be asked once a deployment, not once a name."""
    first: dict = {}
    for name, handle in models.items():
        first.setdefault(_deployment_of(handle), name)
    return list(first.values())


def _deployment_of(handle):
    return getattr(handle, "deployment_id", id(handle))


async def _broadcast(handle, method: str, timeout_s: float, *args) -> list:
    """`method` on every replica: its result, or the exception it raised, or a TimeoutError for a replica that did
    not answer within timeout_s. Serve's `results_async(timeout_s=...)` fails the whole call when one replica
    hangs (a node that stopped answering), which made /health report the model down while others served."""
    response = handle.broadcast(method, *args)
    try:  # Serve's own API has no per-replica timeout: its replica results, each awaited on its own
        replica_results = await asyncio.wait_for(response._fetch_replica_results_async(), timeout_s)
    except AttributeError:  # a Serve without that private method: the whole broadcast under one timeout
        return await response.results_async(timeout_s=timeout_s, return_exceptions=True)
    return list(await asyncio.gather(*(asyncio.wait_for(r.get_async(), timeout_s) for r in replica_results),
                                     return_exceptions=True))


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, models: dict, model_cards: dict[str, dict], config: dict | None = None):
        self.models = models  # served model name -> DeploymentHandle of its LLMServer
        self.model_cards = model_cards
        self.config = IngressConfig(**(config or {}))
        if self.config.prepare_structured_outputs:
            import_in_background()
        self.created = int(time.time())
        self._info: dict[str, tuple[dict, float]] = {}  # served model name -> (a replica's model_info, when)
        self._replicas_seen: dict[str, set[str]] = {}  # served model name -> the replicas that answered it
        self._info_asked: dict[str, asyncio.Future] = {}  # served model name -> its model_info call in flight
        by_deployment: dict = {}  # aliases share their deployment's admission
        self._admissions = {name: by_deployment.setdefault(_deployment_of(handle),
                                                           Admission(self.config.max_prompts.get(name)))
                            for name, handle in models.items()}
        self.lora = LoRARegistry(LoRAConfig(**self.config.lora))

    # ---- OpenAI API -----------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, self._completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, self._chat)

    @app.get("/v1/models")
    async def list_models(self, request: Request):
        return await self._serve(request, self._models, read_body=False)

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(self, request: Request, model: str):
        """The openai client's models.retrieve(id); a model name may hold slashes (org/name)."""
        async def card(request: Request, body: bytes, request_id: str) -> Response:
            if model in self.model_cards:
                return JSONResponse(self._card(model))
            adapter = await self.lora.get(model)
            if adapter is None:
                raise errors.ModelNotFoundError(model, await self._served_names())
            return JSONResponse(self._adapter_card(adapter))

        return await self._serve(request, card, read_body=False)

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._serve(request, self._tokenize)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._serve(request, self._detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request, model: str | None = None):
        """vLLM's: the tokenizer's configuration (lm-eval's remote tokenizer asks for it)."""
        async def info(request: Request, body: bytes, request_id: str) -> Response:
            target = await self._target(model)
            return JSONResponse(await self._call(target.handle.tokenizer_info.remote()))

        return await self._serve(request, info, read_body=False)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self):
        base = get_openapi(title=app.title, version=app.version, routes=app.routes)
        facts = {}
        for name, handle in self.models.items():  # what each model accepts (a model with no replica: unbounded)
            try:
                facts[name] = ModelFacts.from_info(await self._model_info(name, handle),
                                                   self.config.max_prompts.get(name))
            except Exception as e:  # noqa: BLE001 - the document without that model's bounds
                logger.warning("/openapi.json without the bounds of %s: %s", name, e)
        adapters = await self.lora.list()  # each a model name too, with its base's bounds
        facts |= {a.name: facts[a.base_model_name] for a in adapters if a.base_model_name in facts}
        return JSONResponse(openapi_schema(base, list(self.models) + [a.name for a in adapters], facts))

    async def _completions(self, request: Request, body: bytes, request_id: str) -> Response:
        req = CompletionRequest.model_validate_json(body)
        target = await self._target(req.model)
        name, handle = target.base, target.handle
        info = await self._model_info(name, handle)
        params = await asyncio.to_thread(req.to_sampling_params, info["sampling_defaults"])  # a grammar compiles
        prompts = req.prompts()
        limit = self.config.max_prompts.get(name)
        if limit is not None and len(prompts) > limit:
            raise errors.InvalidRequestError(
                f"{len(prompts)} prompts in one request: {name!r} admits {limit} at once (its replicas' "
                "max_ongoing_requests and the max_queued_requests); send them in smaller batches", "prompt")
        if params.truncate_prompt_tokens is None:  # else the replica keeps what fits
            _check_length(info, [p for p in prompts if isinstance(p, str)], "prompt")
        arrival = time.time()
        run = await self._start(name, handle, [
            GenerateRequest(f"{_engine_id(request_id)}-{i}", params, prompt=p, stream=req.stream, echo=req.echo,
                            return_token_ids=req.return_token_ids, arrival_time=arrival,
                            routing_key=p if isinstance(p, str) else " ".join(map(str, p)), lora_request=target.lora)
            for i, p in enumerate(prompts)], params.n, request_id)
        meta = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                "model": target.name}
        if req.stream:
            return sse_response(completion_chunks(meta, req, run.accepted, run.n, run.deltas()), run)
        out = await unless_disconnected(request, run, run.outputs())
        return JSONResponse(completion_body(meta, req, run.accepted, run.n, out), headers=run.headers)

    async def _chat(self, request: Request, body: bytes, request_id: str) -> Response:
        req = ChatCompletionRequest.model_validate_json(body)
        target = await self._target(req.model)
        name, handle = target.base, target.handle
        info = await self._model_info(name, handle)
        params = await asyncio.to_thread(req.to_sampling_params, self.config.default_max_tokens,
                                         info["sampling_defaults"])
        tool_parser = _tool_parser(req, info)
        messages = req.message_dicts()
        if params.truncate_prompt_tokens is None:  # else the replica keeps what fits
            _check_length(info, ["".join(m["content"] for m in messages)], "messages")
        gen = GenerateRequest(_engine_id(request_id), params, messages=messages, stream=req.stream,
                              add_generation_prompt=generation_prompt(req),
                              continue_final_message=req.continue_final_message,
                              chat_template_kwargs=req.chat_template_kwargs, tools=req.tool_dicts(),
                              return_token_ids=req.return_token_ids, routing_key=req.routing_key(),
                              arrival_time=time.time(), lora_request=target.lora)
        try:
            run = await self._start(name, handle, [gen], params.n, request_id)
        except errors.PagodaHTTPError as e:
            raise e.renamed(req.param_name(e.param)) from None
        meta = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": target.name}
        if req.stream:
            chunk_meta = {**meta, "object": "chat.completion.chunk"}
            return sse_response(chat_chunks(chunk_meta, req, run.accepted, run.n, run.deltas(), tool_parser), run)
        out = await unless_disconnected(request, run, run.outputs())
        return JSONResponse(chat_body(meta, req, run.accepted, out, tool_parser), headers=run.headers)

    async def _models(self, request: Request, body: bytes, request_id: str) -> Response:
        cards = [self._card(name) for name in self.model_cards]
        cards += [self._adapter_card(adapter) for adapter in await self.lora.list()]
        return JSONResponse({"object": "list", "data": cards})

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pagoda", "parent": None,
                **self.model_cards[name]}

    def _adapter_card(self, adapter: LoRAModule) -> dict:
        return {"id": adapter.name, "object": "model", "created": self.created, "owned_by": "pagoda",
                **adapter.card()}

    # ---- LoRA adapters at run time (vLLM's endpoints) -------------------------------------------------------------
    @app.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(self, request: Request):
        return await self._serve(request, self._load_lora_adapter)

    @app.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(self, request: Request):
        return await self._serve(request, self._unload_lora_adapter)

    async def _load_lora_adapter(self, request: Request, body: bytes, request_id: str) -> Response:
        """Every replica of the base model checks the adapter (its files on that node, its shapes and rank), then
        its name is published to every ingress replica; a bad adapter is a 400 naming it and nothing changes."""
        self._require_runtime_lora(request)
        req = LoadLoRAAdapterRequest.model_validate_json(body)
        base = self._lora_base(req.base_model_name)
        if req.lora_name in self.models:
            raise errors.InvalidRequestError(f"a model or LoRA adapter named {req.lora_name!r} is served already",
                                             "lora_name")

        async def check(module: LoRAModule) -> None:
            results = await self._broadcast(base, "check_lora_adapter", module.request)
            answered = [r for r in results if not isinstance(r, BaseException)]
            if not answered:
                raise errors.ServiceUnavailableError(f"no replica of {base!r} answered; retry shortly")
            for r in answered:
                if isinstance(r, ErrorInfo):
                    raise r.to_exception()

        await self.lora.add(req.lora_name, req.lora_path, base, check)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    async def _unload_lora_adapter(self, request: Request, body: bytes, request_id: str) -> Response:
        """The name stops resolving at every ingress replica; requests that run with the adapter finish."""
        self._require_runtime_lora(request)
        req = UnloadLoRAAdapterRequest.model_validate_json(body)
        await self.lora.remove(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    def _require_runtime_lora(self, request: Request) -> None:
        if not self.lora.config.allow_runtime_updating:
            raise errors.NotFoundError(f"{request.method} {request.url.path}: Not Found (loading LoRA adapters at "
                                       "run time is off: set PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1 or the app arg "
                                       "allow_runtime_lora_updating)")

    def _lora_base(self, name: str | None) -> str:
        """The served model a runtime adapter goes on: the one given, or the only one that takes adapters."""
        models = self.lora.config.models
        if name is None:
            if len(models) == 1:
                return models[0]
            raise errors.InvalidRequestError(f"base_model_name is required: models that take LoRA adapters: {models}"
                                             if models else "no served model takes LoRA adapters (enable_lora)",
                                             "base_model_name")
        base = next((m for m in models if self.models.get(name) is self.models.get(m)), None)
        if base is None:
            raise errors.InvalidRequestError(f"base_model_name {name!r} is not a served model that takes LoRA "
                                             f"adapters ({models})", "base_model_name")
        return base

    async def _tokenize(self, request: Request, body: bytes, request_id: str) -> Response:
        req = TokenizeRequest.model_validate_json(body)
        tokenize = req.to_input()
        target = await self._target(req.model)
        return JSONResponse(await self._call(target.handle.tokenize.remote(tokenize)))

    async def _detokenize(self, request: Request, body: bytes, request_id: str) -> Response:
        req = DetokenizeRequest.model_validate_json(body)
        target = await self._target(req.model)
        return JSONResponse(await self._call(target.handle.detokenize.remote(req.tokens)))

    # ---- operations ---------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        """200 "ok" when every replica is healthy, 200 "degraded" when some are not but every model has one that
        is, 503 when a model has none."""
        try:
            models = {}
            for name in dict.fromkeys(self.models.values()):  # aliases share one deployment
                results = await _broadcast(name, "check_health", self.config.health_timeout_s)
                healthy = sum(not isinstance(r, Exception) for r in results)
                models[self._name_of(name)] = {"replicas": len(results), "healthy": healthy}
                if not healthy:
                    logger.warning("no healthy replica of %s: %s", self._name_of(name), results or "none")
                    raise errors.ServiceUnavailableError(f"no healthy replica of {self._name_of(name)!r}")
        except Exception as e:  # noqa: BLE001 - an error of any kind is answered as the edge maps it
            return _error_response(e, None)
        degraded = any(m["healthy"] < m["replicas"] for m in models.values())
        return JSONResponse({"status": "degraded" if degraded else "ok", "models": models})

    @app.get("/metrics", include_in_schema=False)
    async def metrics(self):
        snapshots = []
        for name in _one_name_per_deployment(self.models):
            try:
                snapshots += [r for r in await self._broadcast(name, "collect_metrics") if isinstance(r, list)]
            except Exception as e:  # noqa: BLE001 - a model with no replica has no metrics; the others still do
                logger.warning("metrics of %s unavailable: %s", name, e)
        return Response(merge_families(snapshots), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/integrity", include_in_schema=False)
    async def integrity(self, request: Request):
        return await self._serve(request, self._integrity, read_body=False)

    async def _integrity(self, request: Request, body: bytes, request_id: str) -> Response:
        self._require_debug(request)
        reports = {name: [r if isinstance(r, dict) else {"ok": False, "error": repr(r)}
                          for r in await self._broadcast(name, "check_integrity")] for name in self.models}
        ok = all(r["ok"] for rs in reports.values() for r in rs)
        return JSONResponse({"ok": ok, "models": reports})

    @app.post("/debug/fail_engine", include_in_schema=False)
    async def fail_engine(self, request: Request):
        return await self._serve(request, self._fail_engine)

    async def _fail_engine(self, request: Request, body: bytes, request_id: str) -> Response:
        self._require_debug(request)
        try:
            model = json.loads(body or b"{}").get("model")
        except (ValueError, AttributeError):
            raise errors.InvalidRequestError("the body must be a JSON object with 'model'") from None
        name, _ = self._model(model)
        return JSONResponse({"replicas": await self._broadcast(name, "fail_engine")})

    # ---- plumbing -------------------------------------------------------------------------------------------------
    async def _serve(self, request: Request, handler: Callable[[Request, bytes, str], Awaitable[Response]],
                     read_body: bool = True) -> Response:
        request_id = _request_id(request)
        try:
            self._authorize(request)
            body = await self._read_body(request) if read_body else b""
            return await handler(request, body, request_id)
        except errors.ClientDisconnectedError:
            return Response(status_code=499)  # nobody reads it
        except Exception as e:  # noqa: BLE001 - an error of any kind is answered as the edge maps it
            return _error_response(e, request_id)

    def _authorize(self, request: Request) -> None:
        if not self.config.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise errors.AuthenticationError("missing or invalid API key (send 'Authorization: Bearer <key>')")

    def _require_debug(self, request: Request) -> None:
        if not self.config.debug:
            raise errors.NotFoundError(f"{request.method} {request.url.path}: Not Found (start with debug: true)")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        too_large = errors.PayloadTooLargeError(f"the request body exceeds {limit} bytes")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _model(self, model: str | None):
        if model is None:
            if len(self.models) == 1:
                return next(iter(self.models.items()))
            raise errors.InvalidRequestError("model is required (several models are served)", "model")
        if model not in self.models:
            raise errors.ModelNotFoundError(model, list(self.models))
        return model, self.models[model]

    async def _target(self, model: str | None) -> Target:
        """A served model, or a LoRA adapter on one (404 for neither)."""
        if model is None or model in self.models:
            name, handle = self._model(model)
            return Target(name, name, handle)
        adapter = await self.lora.get(model)
        if adapter is None:
            raise errors.ModelNotFoundError(model, await self._served_names())
        return Target(model, adapter.base_model_name, self.models[adapter.base_model_name], adapter.request)

    async def _served_names(self) -> list[str]:
        return list(self.models) + [adapter.name for adapter in await self.lora.list()]

    async def _model_info(self, name: str, handle) -> dict:
        """What the edge needs of a model (its longest prompt, its sampling defaults), asked of a replica. Kept until
        a replica this ingress has not seen answers (a model redeployed with other limits has new replicas; a
        replaced one costs one call), and asked again in the background once MODEL_INFO_TTL_S old. One call at a
        time: a burst does not ask once a request."""
        cached = self._info.get(name)
        if cached is not None and time.monotonic() - cached[1] <= MODEL_INFO_TTL_S:
            return cached[0]
        asked = self._info_asked.get(name)
        if asked is None or asked.done():
            asked = self._info_asked[name] = asyncio.ensure_future(self._ask_model_info(name, handle))
            asked.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is the next caller's
        if cached is not None:
            return cached[0]  # stale by a few seconds while it is asked again
        return await asyncio.shield(asked)  # a caller that leaves does not cancel the others' call

    async def _ask_model_info(self, name: str, handle) -> dict:
        info = await self._call(handle.model_info.remote())
        self._replicas_seen.setdefault(name, set()).add(info["replica"])
        self._info[name] = (info, time.monotonic())
        return info

    def _note_replica(self, name: str, replica: str) -> None:
        seen = self._replicas_seen.setdefault(name, set())
        if replica not in seen:
            if len(seen) >= 10_000:  # replicas come and go for as long as the ingress runs
                seen.clear()
            seen.add(replica)
            self._info.pop(name, None)  # its limits may not be the cached ones: the next request asks again

    async def _start(self, name: str, handle, requests: list[GenerateRequest], n: int, request_id: str) -> RequestRun:
        """Admits the request (a slot a prompt, or a 429), sends every prompt, then waits until each replica accepted
        it; any refusal fails the whole request. A replica lost before it accepted is retried once (on another)."""
        release = self._admissions[name].admit(len(requests))
        gens = []
        try:
            for r in requests:
                gens.append(handle.options(stream=True).generate.remote(r))
            accepted = []
            for i, gen in enumerate(gens):
                try:
                    first = await self._accepted(name, gen)
                except Exception as e:
                    if not is_replica_loss(e):
                        raise
                    gens[i], first = await self._resend(name, handle, requests[i])
                accepted.append(first)
        except BaseException:
            for gen in gens:
                gen.cancel()
            release()
            raise

        async def restart(i: int):
            gen, _ = await self._resend(name, handle, requests[i])
            return gen

        return RequestRun(gens, accepted, n, request_id, restart, release)

    async def _resend(self, name: str, handle, request: GenerateRequest):
        retry = replace(request, request_id=f"{request.request_id}-retry")
        gen = handle.options(stream=True).generate.remote(retry)
        try:
            return gen, await self._accepted(name, gen)
        except BaseException:
            gen.cancel()
            raise

    async def _accepted(self, name: str, gen) -> Accepted:
        try:
            first = await asyncio.wait_for(gen.__anext__(), self.config.accept_timeout_s)
        except asyncio.TimeoutError:
            raise AcceptTimeout(
                f"no replica of {name!r} accepted the request within {self.config.accept_timeout_s:.0f}s") from None
        if isinstance(first, ErrorInfo):
            raise first.to_exception()
        self._note_replica(name, first.replica)
        return first

    async def _call(self, response):
        try:
            result = await asyncio.wait_for(response, self.config.accept_timeout_s)
        except asyncio.TimeoutError:
            raise errors.ServiceUnavailableError("no replica answered in time") from None
        if isinstance(result, ErrorInfo):
            raise result.to_exception()
        return result

    async def _broadcast(self, name: str, method: str, *args) -> list:
        return await _broadcast(self.models[name], method, self.config.control_timeout_s, *args)

    def _name_of(self, handle) -> str:
        return next(name for name, h in self.models.items() if h is handle)
