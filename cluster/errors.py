"""Errors at the HTTP edge: typed errors and the ONE function that maps any exception to an OpenAI error.

    {"error": {"message": "temperature must be non-negative, got -1.0", "type": "invalid_request_error",
               "param": "temperature", "code": 400},
     "request_id": "cmpl-..."}            (code: a string where OpenAI has one, e.g. "model_not_found"; else the status)

Replicas never raise for a bad request: they return an `ErrorInfo` value (see cluster/server.py), which the ingress
turns back into one of the errors here. Everything else (pydantic, the engine's ParamError, Ray Serve's back
pressure, a dead engine) is mapped by `to_http_error`. What a client reads is a plain message: Ray's own error
texts (actor ids, pids, node addresses) stay in the log, with the request id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.errors import EngineDeadError, ParamError

logger = logging.getLogger(__name__)


class PagodaHTTPError(Exception):
    """An error with an HTTP status and an OpenAI error type."""

    status_code = 500
    error_type = "internal_server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(PagodaHTTPError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(PagodaHTTPError):
    status_code = 401
    error_type = "authentication_error"


class ModelNotFoundError(PagodaHTTPError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str | None, available: list[str]):
        super().__init__(f"The model {model!r} does not exist. Available models: {', '.join(available)}",
                         param="model", code="model_not_found")


class NotFoundError(PagodaHTTPError):
    status_code = 404
    error_type = "invalid_request_error"


class PayloadTooLargeError(PagodaHTTPError):
    status_code = 413
    error_type = "invalid_request_error"


class TooManyRequestsError(PagodaHTTPError):
    """The replicas' queues are full (Serve's max_queued_requests): try again after `retry_after_s`."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    retry_after_s = 1


class ServiceUnavailableError(PagodaHTTPError):
    status_code = 503
    error_type = "service_unavailable"


class ClientDisconnectedError(PagodaHTTPError):
    """The client went away before the answer: nothing is sent (logged as 499, nginx's code for it)."""

    status_code = 499
    error_type = "client_closed_request"


class InternalServerError(PagodaHTTPError):
    status_code = 500
    error_type = "internal_server_error"


_STATUS_TO_ERROR = {400: InvalidRequestError, 401: AuthenticationError, 404: NotFoundError,
                    413: PayloadTooLargeError, 429: TooManyRequestsError, 503: ServiceUnavailableError,
                    500: InternalServerError}


@dataclass
class ErrorInfo:
    """An error as a value: what a replica returns instead of raising across the Serve boundary."""

    status_code: int
    message: str
    param: str | None = None

    def to_exception(self) -> PagodaHTTPError:
        return _STATUS_TO_ERROR.get(self.status_code, InternalServerError)(self.message, self.param)


def to_http_error(exc: BaseException) -> PagodaHTTPError:
    """The one mapping from any exception to an HTTP error (status, OpenAI type, param)."""
    from pydantic import ValidationError

    cause = unwrap(exc)
    if isinstance(cause, PagodaHTTPError):
        return cause
    if isinstance(cause, ValidationError):
        return _from_validation_error(cause)
    if _is_back_pressure(cause):
        return TooManyRequestsError("every replica's queue is full; retry shortly")
    if _is_serve_unavailable(cause):
        logger.warning("no replica available: %s", cause)
        return ServiceUnavailableError("no replica is ready to serve this request; retry shortly")
    if isinstance(cause, EngineDeadError):  # the replica fails its health check and Serve replaces it
        return ServiceUnavailableError("the model's engine is restarting; retry shortly")
    if isinstance(cause, TimeoutError):
        return ServiceUnavailableError("no replica answered in time; retry shortly")
    if isinstance(cause, ParamError):
        return InvalidRequestError(str(cause), cause.param)
    logger.error("internal error: %s: %s", type(cause).__name__, cause, exc_info=cause)
    return InternalServerError(f"internal error ({type(cause).__name__})")


def http_status_error(status_code: int, message: str) -> PagodaHTTPError:
    """An error for a status that only the HTTP framework produces (unknown route, wrong method)."""
    error = _STATUS_TO_ERROR.get(status_code, InvalidRequestError)(message)
    error.status_code = status_code
    return error


def error_body(error: PagodaHTTPError, request_id: str | None) -> dict:
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param,
                      "code": error.code if error.code is not None else error.status_code},
            "request_id": request_id}


def _from_validation_error(e) -> InvalidRequestError:
    first = e.errors()[0] if e.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if not str(part).isdigit()]
    param = loc[0] if loc else None
    message = first.get("msg", str(e))
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    where = ".".join(str(part) for part in first.get("loc", ()))
    return InvalidRequestError(f"{where}: {message}" if where else message, param)


def unwrap(exc: BaseException) -> BaseException:
    """Ray wraps exceptions raised in another process (RayTaskError); the cause is what matters."""
    cause = getattr(exc, "cause", None)
    if cause is not None and type(exc).__name__.startswith("RayTaskError"):
        return cause
    return exc


def _is_back_pressure(exc: BaseException) -> bool:
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, BackPressureError)


def _is_serve_unavailable(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(exc, (DeploymentUnavailableError, ActorDiedError, ActorUnavailableError, RayActorError))
