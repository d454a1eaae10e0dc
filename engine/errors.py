"""The engine's typed errors. They are values the HTTP edge maps to status codes (cluster/errors.py), so each says
what it is instead of being parsed out of a message."""

from __future__ import annotations

MAX_QUOTED_CHARS = 100  # what an error message quotes of a client's input, at most (a 1 MB model name is cut)


def shortened(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """`text` cut to `limit` characters, with an ellipsis and the full length where it was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quoted(value) -> str:
    """repr(value) as an error message quotes a client's input: shortened to MAX_QUOTED_CHARS."""
    return shortened(repr(value))


class ParamError(ValueError):
    """Invalid input, naming the request field at fault: `ParamError("top_p", "must be in (0, 1], got 0")` reads
    "top_p must be in (0, 1], got 0". `param` is None when no single field is to blame."""

    def __init__(self, param: str | None, message: str):
        super().__init__(f"{param} {message}" if param else message)
        self.param = param

    @property
    def message(self) -> str:
        """What is wrong, without the field's name."""
        text = str(self)
        return text[len(self.param) + 1:] if self.param and text.startswith(f"{self.param} ") else text

    def renamed(self, param: str) -> ParamError:
        """The same error about the field as the client named it (`tools[0].function.parameters` for the schema it
        became)."""
        return ParamError(param, self.message)

    def __reduce__(self):  # crosses Ray's process boundaries intact
        return _rebuild_param_error, (self.param, str(self))


def _rebuild_param_error(param: str | None, text: str) -> ParamError:
    error = ParamError(None, text)
    error.param = param
    return error


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a worker died or a step crashed); the replica must be replaced."""
