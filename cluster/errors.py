"""Errors at the HTTP edge: typed errors and the ONE function that maps any exception to an OpenAI error.

    {"error": {"message": "temperature must be non-negative, got -1.0", "type": "invalid_request_error",
               "param": "temperature", "code": null},
     "request_id": "..."}        (code: a string where OpenAI has one, e.g. "model_not_found"; else null, as OpenAI's)

Replicas never raise for a bad request: they return an `ErrorInfo` value (see cluster/server.py), which the ingress
turns back into one of the errors here. Everything else (pydantic, the engine's ParamError, Ray Serve's back
pressure, a dead engine) is mapped by `to_http_error`. What a client reads is a plain message: Ray's own error
texts (actor ids, pids, node addresses) stay in the log, with the request id. No message echoes much of a request:
what one quotes of the client's input goes through `quoted` / `shortened` (engine/errors.py), and `error_body` cuts
any message to MAX_MESSAGE_CHARS besides.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from engine.errors import EngineDeadError, ParamError, quoted, shortened

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1000  # an error message's length at most, whatever it quotes
JSON_DEPTH_LIMIT = 200  # pydantic's JSON parser refuses deeper nesting


class PagodaHTTPError(Exception):
    """An error with an HTTP status and an OpenAI error type."""

    status_code = 500
    error_type = "internal_server_error"
    code: str | None = None  # OpenAI's error code (a string or null)

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def renamed(self, param: str | None) -> PagodaHTTPError:
        """The error about the field as the client named it (the engine says max_tokens for the client's
        max_completion_tokens): its param and the message that starts with the engine's name."""
        if param is not None and param != self.param:
            if self.param and self.message.startswith(f"{self.param} "):
                self.message = f"{param} {self.message[len(self.param) + 1:]}"
            self.param = param
        return self


class InvalidRequestError(PagodaHTTPError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(PagodaHTTPError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFoundError(PagodaHTTPError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str | None, available: list[str]):
        super().__init__(f"The model {quoted(model)} does not exist. Available models: {', '.join(available)}",
                         param="model")


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
    code = "rate_limit_exceeded"
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
    """OpenAI's error JSON: `code` a string or null, as OpenAI's (and the openai client's type) has it."""
    param = shortened(error.param) if error.param else error.param
    return {"error": {"message": shortened(error.message, MAX_MESSAGE_CHARS), "type": error.error_type,
                      "param": param, "code": error.code},
            "request_id": request_id}


# ---- pydantic's errors as one message ------------------------------------------------------------------------------
# A union field's errors come one per member, each `loc` holding the member's tag ("str", "list[constrained-int]",
# a model's class name) after the field. The error that says what is wrong is the member's that the input's JSON
# type matched: it is not a type mismatch, it got deepest, furthest into a list.
_MISMATCH = re.compile(r"(_type|_parsing|union_tag_invalid|is_instance_of)$")  # (a literal_error: the type matched)
_FIELD_ERRORS = ("extra_forbidden", "missing")  # their loc ends in a field's name, never a tag
_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|(list|dict|set|tuple|literal|nullable|json-or-python|"
                        r"function-[a-z]+|constrained-[a-z]+)\[.*|constrained-[a-z]+|[A-Z]\w*)$")


def _from_validation_error(e) -> InvalidRequestError:
    errors = e.errors(include_url=False)
    if not errors:
        return InvalidRequestError(shortened(str(e), MAX_MESSAGE_CHARS))
    first = errors[0]
    if first["type"] == "json_invalid":
        return _invalid_json(first)
    group = [err for err in errors if err["loc"][:1] == first["loc"][:1]]  # the first field at fault
    chosen = max(group, key=_relevance)
    message = _union_mismatch(group) or chosen["msg"]
    if chosen["type"] == "extra_forbidden":
        message = "unknown field (Pagoda refuses the fields it does not implement)"
    where = _where(chosen["loc"], chosen["type"] in _FIELD_ERRORS)
    param = shortened(str(first["loc"][0])) if first["loc"] else None
    return InvalidRequestError(f"{where}: {shortened(message, 300)}" if where else shortened(message, 300), param)


def _relevance(err: dict) -> tuple:
    loc = err["loc"]
    return not _MISMATCH.search(err["type"]), len(loc), tuple(part for part in loc if isinstance(part, int))


def _is_tag(part) -> bool:
    return isinstance(part, str) and bool(_UNION_TAG.match(part))


def _where(loc: tuple, ends_in_field: bool = False) -> str:
    """`prompt[0]` for ("prompt", "list[constrained-int]", 0): fields dotted, indexes bracketed, union tags out."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part) or (ends_in_field and i == len(loc) - 1):
            out += f"{'.' if out else ''}{shortened(str(part))}"
    return out


def _union_mismatch(group: list[dict]) -> str | None:
    """A value that matches no member's type at all: one message naming the members, not the first one's."""
    tags = [next((p for p in err["loc"] if _is_tag(p)), None) for err in group]
    if len(group) < 2 or None in tags or not all(_MISMATCH.search(err["type"]) for err in group):
        return None
    if len({len(err["loc"]) for err in group}) > 1 or any(err["loc"][-1] != tag for err, tag in zip(group, tags)):
        return None  # not all at the union itself
    kinds = [re.sub(r"function-[a-z]+\[[^,\]]*, ([^\]]+)\]", r"\1", tag).replace("constrained-", "") for tag in tags]
    return f"Input should be one of: {', '.join(dict.fromkeys(kinds))}"


def _invalid_json(err: dict) -> InvalidRequestError:
    detail = str(err.get("ctx", {}).get("error", ""))
    if not detail.startswith("recursion limit exceeded"):
        return InvalidRequestError(f"the request body is not valid JSON: {shortened(detail, 300)}")
    text = err.get("input", "")
    text = text.decode(errors="replace") if isinstance(text, (bytes, bytearray)) else str(text)
    field = _top_level_key(text[:_offset(text, detail)])
    what = f"{shortened(field)} nests" if field is not None else "the request body nests"
    return InvalidRequestError(f"{what} arrays and objects more than {JSON_DEPTH_LIMIT} levels deep", field)


def _offset(text: str, detail: str) -> int:
    """The character offset of pydantic's "at line L column C"."""
    found = re.search(r"line (\d+) column (\d+)", detail)
    if not found:
        return len(text)
    line, column = int(found.group(1)), int(found.group(2))
    lines = text.split("\n", line - 1)
    return sum(len(part) + 1 for part in lines[:line - 1]) + column


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:]')


def _top_level_key(prefix: str) -> str | None:
    """The key of the top-level member that `prefix` (a JSON object's start) ends in."""
    depth, key, last_string = 0, None, None
    for match in _JSON_TOKEN.finditer(prefix):
        token = match.group()
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
        elif token == ":":
            if depth == 1 and last_string is not None:
                try:
                    key = json.loads(last_string)
                except ValueError:
                    key = last_string[1:-1]
        else:
            last_string = token
    return key


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
