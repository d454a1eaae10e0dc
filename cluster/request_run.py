"""One HTTP request's generation across model replicas, for the ingress (cluster/ingress.py): its replica streams
(one per prompt), the retry of a stream whose replica was lost before it produced anything, the abort when the
client disconnects, and the SSE response. Kept apart from the ingress's routes: nothing here knows FastAPI's app."""

import asyncio
import json
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from cluster import errors
from cluster.errors import ErrorInfo
from cluster.protocol import Accepted
from cluster.responses import Outputs
from engine.request_output import RequestDelta, RequestError

logger = logging.getLogger(__name__)


class Admission:
    """The calls (one per prompt) that one model's deployment has in flight from this ingress replica: at most
    `limit` (its replicas' max_ongoing_requests x replicas + max_queued_requests; None: no limit), beyond which a
    request is a 429. Counted here rather than by Serve's router, whose queue check also counts the requests it is
    still routing: a burst that the replicas had room for was refused in a varying part (82 of 100 admitted in one
    run, 17 in another)."""

    def __init__(self, limit: int | None):
        self.limit, self.num_in_flight = limit, 0
        self._lock = threading.Lock()  # a release may come from a garbage collection on another thread

    def admit(self, num_calls: int) -> Callable[[], None]:
        """Takes num_calls slots, or raises TooManyRequestsError; returns their release (once; later calls no-op)."""
        with self._lock:
            if self.limit is not None and self.num_in_flight + num_calls > self.limit:
                raise errors.TooManyRequestsError(f"this model has {self.num_in_flight} requests in flight or "
                                                  f"queued, as many as it admits ({self.limit}); retry shortly")
            self.num_in_flight += num_calls

        def release():
            nonlocal num_calls
            with self._lock:
                self.num_in_flight -= num_calls
                num_calls = 0

        return release


class RequestRun:
    """The replica streams of one HTTP request, one per prompt, each already accepted. A stream whose replica is
    lost before it produced anything is started again once, on another replica (`restart`): its client sees
    nothing of it; one lost after its first token ends with an error. Each prompt of a batch has its own retry: a
    replica lost under several prompts of one batch restarts each of them."""

    def __init__(self, gens: list, accepted: list[Accepted], n: int, request_id: str, restart=None,
                 release: Callable[[], None] | None = None):
        self.gens, self.accepted, self.n, self.request_id = gens, accepted, n, request_id
        self.restart = restart  # async (prompt index) -> a new, accepted stream
        self.restarted: set[int] = set()  # the prompts whose one retry is spent
        # The run's admission slots go back when it is cancelled (every answer's end cancels it), or else when it
        # is collected: a run that some path forgot must not hold its slots for good.
        self._release = weakref.finalize(self, release) if release is not None else None
        self.prompt_tokens = sum(a.num_prompt_tokens for a in accepted)
        self.headers = {"X-Pagoda-Replica": ",".join(dict.fromkeys(a.replica for a in accepted)),
                        "X-Pagoda-Request-Id": request_id}

    async def _stream(self, i: int) -> AsyncIterator[RequestDelta]:
        produced = False
        while True:
            try:
                async for item in self.gens[i]:
                    for delta in _checked(item, self.request_id):
                        produced = produced or bool(delta.num_new_tokens) or delta.finished
                        yield delta
                return
            except Exception as e:
                if produced and is_actor_loss(e):  # the client has part of it: no retry can continue it
                    raise errors.ServiceUnavailableError("the replica serving this request was lost after it had "
                                                         "produced output; send the request again") from e
                if produced or self.restart is None or i in self.restarted or not is_replica_loss(e):
                    raise
                logger.warning("request %s, prompt %d: its replica was lost before any output; retrying once (%s)",
                               self.request_id, i, type(e).__name__)
                self.restarted.add(i)
                self.gens[i] = await self.restart(i)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(prompt index, delta) as they arrive from every stream; an error item raises."""
        if len(self.gens) == 1:
            async for delta in self._stream(0):
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i):
            try:
                async for delta in self._stream(i):
                    queue.put_nowait((i, delta))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.gens))]
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

    async def outputs(self) -> Outputs:
        """Every sequence's whole output and every prompt's prompt logprobs (requests that do not stream get one
        delta, the final)."""
        out = Outputs()
        async for p, delta in self.deltas():
            out.add(p, self.n, delta)
        return out

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()
        if self._release is not None:
            self._release()


def is_replica_loss(e: BaseException) -> bool:
    """The replica (or its engine) went away: the request itself is not at fault."""
    cause = errors.unwrap(e)
    return is_actor_loss(e) or (
        isinstance(cause, errors.ServiceUnavailableError) and not isinstance(cause, AcceptTimeout))


def is_actor_loss(e: BaseException) -> bool:
    """The replica's actor itself is gone (its process or its node), as Ray reports it."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(errors.unwrap(e), (ActorDiedError, ActorUnavailableError, RayActorError))


class AcceptTimeout(errors.ServiceUnavailableError):
    """No replica took the request in time: waiting again would only double the wait."""


def _checked(item, request_id: str) -> list[RequestDelta]:
    """A replica's item of deltas, or the error it carries: an ErrorInfo, or a delta whose request the engine
    failed, by the kind of its RequestError (invalid: a 400 naming the field; unavailable: a 503 to retry; the
    engine's fault: a 500 whose reason stays in the log)."""
    if isinstance(item, ErrorInfo):
        raise item.to_exception()
    for delta in item:
        error = delta.error
        if error is None:
            continue
        if error.kind == RequestError.INVALID:
            raise errors.InvalidRequestError(error.message, error.param)
        if error.kind == RequestError.UNAVAILABLE:
            raise errors.ServiceUnavailableError(error.message)
        logger.error("request %s: the engine failed it: %s", request_id, error.message)
        raise errors.InternalServerError("the engine failed this request")
    return item


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read already: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def unless_disconnected(request: Request, run: RequestRun, work: Awaitable):
    """`work`'s result; the run is cancelled (its requests aborted) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise errors.ClientDisconnectedError("the client went away")
    finally:
        watcher.cancel()
        run.cancel()


def sse_response(chunks: AsyncIterator[dict], run: RequestRun) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # noqa: BLE001 - the status is sent already: report in the stream, as OpenAI does
            error = errors.to_http_error(e)
            if error.status_code >= 500:
                logger.warning("request %s failed mid-stream: %s", run.request_id, error.message)
            yield f"data: {json.dumps(errors.error_body(error, run.request_id))}\n\n"
        finally:
            run.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers=run.headers | {"Cache-Control": "no-cache"})
