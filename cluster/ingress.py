"""The OpenAI-compatible HTTP edge: a FastAPI app behind Ray Serve, CPU only, N replicas.

    POST /v1/completions, /v1/chat/completions   (SSE when stream=true)     GET /v1/models
    POST /tokenize, /detokenize                   GET /health, /metrics      GET /debug/integrity

Each request: authorize (Bearer key) → read the body (size limit, before parsing) → validate (pydantic) → pick the
model's LLMServer handle by `model` → one streaming handle call per prompt → wait for every replica to accept
(or refuse) → answer: JSON, or SSE whose status is already known to be 200. Any exception becomes an OpenAI
error JSON through cluster.errors.to_http_error, with the request id.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import errors
from cluster.errors import ErrorInfo, PagodaHTTPError
from cluster.metrics import merge_families
from cluster.protocol import (ChatCompletionRequest, ChoiceDelta, CompletionRequest, DetokenizeRequest,
                              GenerateRequest, StepDelta, TokenizeRequest, chat_logprobs, completion_logprobs,
                              message_dicts, usage)

logger = logging.getLogger(__name__)

app = FastAPI(title="Pagoda", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException):
    error = errors.http_status_error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(errors.error_body(error, None), status_code=exc.status_code)


@dataclass
class IngressConfig:
    api_key: str | None = None
    max_body_bytes: int = 10 * 1024 * 1024
    accept_timeout_s: float = 60.0  # waiting for a replica to accept a request (none ready: 503)
    control_timeout_s: float = 10.0  # broadcasts: /health, /metrics, /debug/*
    debug: bool = False  # enables POST /debug/fail_engine


class _Run:
    """The replica streams of one HTTP request, one per prompt, each already accepted."""

    def __init__(self, gens: list, accepted: list[StepDelta], n: int):
        self.gens, self.accepted, self.n = gens, accepted, n
        self.prompt_tokens = sum(a.prompt_tokens for a in accepted)
        self.headers = {"X-Pagoda-Replica": ",".join(dict.fromkeys(a.replica for a in accepted))}

    async def deltas(self) -> AsyncIterator[tuple[int, StepDelta]]:
        """(prompt index, delta) as they arrive from every stream."""
        if len(self.gens) == 1:
            async for delta in self.gens[0]:
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for delta in gen:
                    queue.put_nowait((i, delta))
            except Exception as e:
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()


def _raise_if_error(delta: StepDelta) -> None:
    if delta.error is not None:
        raise delta.error.to_exception()


async def _collect(run: _Run) -> dict[int, ChoiceDelta]:
    """Every choice of a non-streaming run, merged, keyed by its index in the response."""
    choices = {p * run.n + j: ChoiceDelta(p * run.n + j) for p in range(len(run.accepted)) for j in range(run.n)}
    try:
        async for p, delta in run.deltas():
            _raise_if_error(delta)
            for c in delta.choices:
                choices[p * run.n + c.index].merge(c)
    finally:
        run.cancel()
    return choices


def _sse(chunks: AsyncIterator[dict], run: _Run, request_id: str) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # the status is sent already: report in the stream, as OpenAI does
            error = errors.to_http_error(e)
            yield f"data: {json.dumps(errors.error_body(error, request_id))}\n\n"
        finally:
            run.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers=run.headers | {"X-Pagoda-Request-Id": request_id, "Cache-Control": "no-cache"})


def _error_response(exc: BaseException, request_id: str | None) -> JSONResponse:
    error = errors.to_http_error(exc)
    if error.status_code >= 500:
        logger.warning("request %s failed: %s", request_id, error.message)
    return JSONResponse(errors.error_body(error, request_id), status_code=error.status_code,
                        headers={"X-Pagoda-Request-Id": request_id} if request_id else None)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, models: dict, model_cards: dict[str, dict], config: dict | None = None):
        self.models = models  # served model name -> DeploymentHandle of its LLMServer
        self.model_cards = model_cards
        self.config = IngressConfig(**(config or {}))
        self.created = int(time.time())

    # ---- OpenAI API -----------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, "cmpl", self._completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, "chatcmpl", self._chat)

    @app.get("/v1/models")
    async def list_models(self, request: Request):
        return await self._serve(request, "models", self._models, read_body=False)

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._serve(request, "tok", self._tokenize)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._serve(request, "detok", self._detokenize)

    async def _completions(self, body: bytes, request_id: str) -> Response:
        req = CompletionRequest.model_validate_json(body)
        name, handle = self._model(req.model)
        params = req.to_sampling_params()
        prompts = req.prompts()
        run = await self._start(name, handle, [
            GenerateRequest(f"{request_id}-{i}", params, prompt=p, stream=req.stream, echo=req.echo,
                            routing_key=p if isinstance(p, str) else " ".join(map(str, p)))
            for i, p in enumerate(prompts)], params.n)
        meta = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": name}
        if req.stream:
            return _sse(self._stream_completion(run, req, meta), run, request_id)
        choices = await _collect(run)
        offsets = {i: len(run.accepted[i // run.n].prompt_text or "") for i in choices}
        body = {**meta, "choices": [
            {"index": i, "text": (run.accepted[i // run.n].prompt_text or "") + c.text,
             "logprobs": completion_logprobs(c.logprobs, offsets[i]) if c.logprobs is not None else None,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, c in sorted(choices.items())],
            "usage": usage(run.prompt_tokens, sum(c.num_tokens for c in choices.values()))}
        return JSONResponse(body, headers=run.headers | {"X-Pagoda-Request-Id": request_id})

    async def _stream_completion(self, run: _Run, req: CompletionRequest, meta: dict) -> AsyncIterator[dict]:
        offsets: dict[int, int] = {}
        no_usage = {"usage": None} if req.include_usage else {}
        for p, accepted in enumerate(run.accepted):
            for j in range(run.n):
                offsets[p * run.n + j] = len(accepted.prompt_text or "")
                if accepted.prompt_text:
                    yield {**meta, "choices": [{"index": p * run.n + j, "text": accepted.prompt_text,
                                                "logprobs": None, "finish_reason": None}], **no_usage}
        completion_tokens = 0
        async for p, delta in run.deltas():
            _raise_if_error(delta)
            for c in delta.choices:
                index = p * run.n + c.index
                completion_tokens += c.num_tokens
                logprobs = completion_logprobs(c.logprobs, offsets[index]) if c.logprobs is not None else None
                offsets[index] += len(c.text)
                yield {**meta, "choices": [{"index": index, "text": c.text, "logprobs": logprobs,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                       **no_usage}
        if req.include_usage:
            yield {**meta, "choices": [], "usage": usage(run.prompt_tokens, completion_tokens)}

    async def _chat(self, body: bytes, request_id: str) -> Response:
        req = ChatCompletionRequest.model_validate_json(body)
        name, handle = self._model(req.model)
        try:
            params = req.to_sampling_params()
            gen = GenerateRequest(request_id, params, messages=req.message_dicts(), stream=req.stream,
                                  add_generation_prompt=req.add_generation_prompt,
                                  chat_template_kwargs=req.chat_template_kwargs, routing_key=req.routing_key())
            run = await self._start(name, handle, [gen], params.n)
        except PagodaHTTPError as e:
            e.param = req.param_name(e.param)
            raise
        meta = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": name}
        if req.stream:
            return _sse(self._stream_chat(run, req, {**meta, "object": "chat.completion.chunk"}), run, request_id)
        choices = await _collect(run)
        body = {**meta, "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text},
             "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, c in sorted(choices.items())],
            "usage": usage(run.prompt_tokens, sum(c.num_tokens for c in choices.values()))}
        return JSONResponse(body, headers=run.headers | {"X-Pagoda-Request-Id": request_id})

    async def _stream_chat(self, run: _Run, req: ChatCompletionRequest, meta: dict) -> AsyncIterator[dict]:
        no_usage = {"usage": None} if req.include_usage else {}
        for j in range(run.n):
            yield {**meta, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **no_usage}
        completion_tokens = 0
        async for _, delta in run.deltas():
            _raise_if_error(delta)
            for c in delta.choices:
                completion_tokens += c.num_tokens
                yield {**meta, "choices": [{"index": c.index, "delta": {"content": c.text} if c.text else {},
                                            "logprobs": chat_logprobs(c.logprobs) if c.logprobs else None,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                       **no_usage}
        if req.include_usage:
            yield {**meta, "choices": [], "usage": usage(run.prompt_tokens, completion_tokens)}

    async def _models(self, body: bytes, request_id: str) -> Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "pagoda", **card}
                for name, card in self.model_cards.items()]
        return JSONResponse({"object": "list", "data": data})

    async def _tokenize(self, body: bytes, request_id: str) -> Response:
        req = TokenizeRequest.model_validate_json(body)
        _, handle = self._model(req.model)
        messages = message_dicts(req.messages) if req.messages is not None else None
        result = await self._call(handle.tokenize.remote(req.prompt, messages, req.add_special_tokens,
                                                         req.add_generation_prompt))
        return JSONResponse(result)

    async def _detokenize(self, body: bytes, request_id: str) -> Response:
        req = DetokenizeRequest.model_validate_json(body)
        _, handle = self._model(req.model)
        return JSONResponse(await self._call(handle.detokenize.remote(req.tokens)))

    # ---- operations ---------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        try:
            for name in self.models:
                results = await self._broadcast(name, "check_health")
                if all(isinstance(r, Exception) for r in results):
                    raise errors.ServiceUnavailableError(f"no healthy replica of {name!r}: {results[0]}")
        except Exception as e:
            return _error_response(e, None)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self):
        snapshots = []
        for name in self.models:
            try:
                snapshots += [r for r in await self._broadcast(name, "collect_metrics") if isinstance(r, list)]
            except Exception as e:  # a model with no replica has no metrics; the others still do
                logger.warning("metrics of %s unavailable: %s", name, e)
        return Response(merge_families(snapshots), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/integrity")
    async def integrity(self, request: Request):
        return await self._serve(request, "debug", self._integrity, read_body=False)

    async def _integrity(self, body: bytes, request_id: str) -> Response:
        reports = {name: [r if isinstance(r, dict) else {"ok": False, "error": repr(r)}
                          for r in await self._broadcast(name, "check_integrity")] for name in self.models}
        ok = all(r["ok"] for rs in reports.values() for r in rs)
        return JSONResponse({"ok": ok, "models": reports})

    @app.post("/debug/fail_engine")
    async def fail_engine(self, request: Request):
        return await self._serve(request, "debug", self._fail_engine)

    async def _fail_engine(self, body: bytes, request_id: str) -> Response:
        if not self.config.debug:
            raise errors.NotFoundError("POST /debug/fail_engine: Not Found (start with debug: true)")
        name, _ = self._model(json.loads(body or b"{}").get("model"))
        return JSONResponse({"replicas": await self._broadcast(name, "fail_engine")})

    # ---- plumbing -------------------------------------------------------------------------------------------------
    async def _serve(self, request: Request, kind: str, handler: Callable[[bytes, str], Awaitable[Response]],
                     read_body: bool = True) -> Response:
        request_id = f"{kind}-{uuid.uuid4().hex}"
        try:
            self._authorize(request)
            body = await self._read_body(request) if read_body else b""
            return await handler(body, request_id)
        except Exception as e:
            return _error_response(e, request_id)

    def _authorize(self, request: Request) -> None:
        if not self.config.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise errors.AuthenticationError("missing or invalid API key (send 'Authorization: Bearer <key>')")

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

    async def _start(self, name: str, handle, requests: list[GenerateRequest], n: int) -> _Run:
        """Sends every prompt, then waits until each replica accepted it; any refusal fails the whole request."""
        gens = [handle.options(stream=True).generate.remote(r) for r in requests]
        try:
            accepted = []
            for gen in gens:
                try:
                    first = await asyncio.wait_for(gen.__anext__(), self.config.accept_timeout_s)
                except asyncio.TimeoutError:
                    raise errors.ServiceUnavailableError(
                        f"no replica of {name!r} accepted the request within {self.config.accept_timeout_s:.0f}s")
                _raise_if_error(first)
                accepted.append(first)
            return _Run(gens, accepted, n)
        except BaseException:
            for gen in gens:
                gen.cancel()
            raise

    async def _call(self, response):
        try:
            result = await asyncio.wait_for(response, self.config.accept_timeout_s)
        except asyncio.TimeoutError:
            raise errors.ServiceUnavailableError("no replica answered in time")
        if isinstance(result, ErrorInfo):
            raise result.to_exception()
        return result

    async def _broadcast(self, name: str, method: str) -> list:
        return await self.models[name].broadcast(method).results_async(
            timeout_s=self.config.control_timeout_s, return_exceptions=True)
