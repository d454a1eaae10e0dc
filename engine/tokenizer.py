"""Tokenizer loading and chat templates (transformers' fast tokenizers; imported lazily)."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time

from engine.errors import ParamError

logger = logging.getLogger(__name__)

# What a request's chat_template_kwargs may not set: the template variables the server sets itself, and the other
# parameters of transformers' apply_chat_template (they would be taken as its arguments, not as variables).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "add_generation_prompt", "tokenize",
                                      "return_dict", "chat_template", "tools", "documents",
                                      "continue_final_message", "sanitize_control_tokens", "padding", "truncation",
                                      "max_length", "return_tensors", "return_assistant_tokens_mask",
                                      "tokenizer_kwargs"})


def load_tokenizer(path: str, chat_template: str | None = None, child: TokenizerChild | None = None):
    """The tokenizer of a checkpoint directory; `chat_template` (the template's text) replaces its own. A directory
    transformers cannot read a tokenizer from is a ValueError naming it (transformers' own message does not).
    `child`: the tokenizer comes from that child process where it could load it (below), else from this one."""
    tokenizer = child.result() if child is not None else None
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(_load_error(path, f"{type(e).__name__}: {e}")) from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# The child: AutoTokenizer's own choice of class and loading; ("ok", tokenizer) or ("error", message) on stdout
# (anything transformers prints goes to stderr, which is the parent's).
_CHILD = """
import pickle, sys
out, sys.stdout = sys.stdout.buffer, sys.stderr
from transformers import AutoTokenizer
try:
    result = ("ok", AutoTokenizer.from_pretrained(sys.argv[1]))
except (OSError, ValueError) as e:
    result = ("error", f"{type(e).__name__}: {e}")
out.write(pickle.dumps(result))
"""


class TokenizerChild:
    """AutoTokenizer in a child process (same interpreter, same import path), started at construction; `result()`
    is the tokenizer, pickled back. To choose the class, AutoTokenizer imports much of transformers' modelling code
    (generation, torch.distributed.tensor, sympy, scikit-learn where installed: 12 s on the H200's host), which in
    the engine's process held the GIL that the model's load and CUDA-graph capture beside it needed (the capture
    took 10 s instead of 2.5); unpickling imports only the tokenizer's own class. The child costs more CPU in all
    (it imports torch too), so it is for a process with other work to do and cores to spare: a GPU engine's."""

    def __init__(self, path: str):
        self.path = path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-c", _CHILD, path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
            self._failure = None
        except OSError as e:  # no interpreter to start
            self._process, self._failure = None, f"{type(e).__name__}: {e}"

    def close(self) -> None:
        """Ends the child if it is still running (a start-up that failed before reading its result)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def result(self):
        """The child's tokenizer; None where the child failed for a reason other than the tokenizer's own (logged:
        the caller loads it itself). A tokenizer that cannot be loaded raises ValueError as load_tokenizer does."""
        status, value = "failed", self._failure
        if self._process is not None:
            try:
                out, _ = self._process.communicate()
                if self._process.returncode != 0:
                    value = f"exit {self._process.returncode}"
                else:
                    status, value = pickle.loads(out)
            except Exception as e:  # noqa: BLE001 - a tokenizer class that does not pickle
                value = f"{type(e).__name__}: {e}"
        if status == "error":
            raise ValueError(_load_error(self.path, value))
        if status != "ok":
            logger.warning("tokenizer %r: the child process could not load it (%s); loading it in this process",
                           self.path, value)
            return None
        return value


def _load_error(path: str, cause: str) -> str:
    return f"tokenizer {path!r} could not be loaded: {cause}"


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, time_limit_s: float | None = None, *,
                        tools: list[dict] | None = None, continue_final_message: bool = False,
                        template_kwargs: dict | None = None) -> str:
    """Renders a conversation to prompt text with the tokenizer's template (or `chat_template`). template_kwargs:
    more variables for the template (none of RESERVED_TEMPLATE_KWARGS; a dict, so that a variable named like one of
    these parameters stays a variable). Raises ParamError on bad messages, a template that rejects them, or one that
    runs past `time_limit_s`."""
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages", "must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ParamError("messages", "each message needs a 'role'")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ParamError("messages", "this model's tokenizer has no chat template")
    try:
        with _deadline(time_limit_s):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, tools=tools,
                                                 continue_final_message=continue_final_message,
                                                 **(template_kwargs or {}))
    except _TemplateTimeout:
        raise ParamError("chat_template", f"rendering ran past its limit of {time_limit_s:g} s") from None
    except Exception as e:  # jinja errors: the template rejected the conversation
        raise ParamError("messages", f"the chat template failed: {e}") from e


class _TemplateTimeout(BaseException):  # not an Exception: jinja must not catch it
    pass


class _deadline:
    """Stops the Python code this thread runs (jinja compiles templates to Python) once `limit_s` has passed: a
    trace function checks the clock at every line. Costs a few times the render's speed, so it is for templates
    that are not the operator's own."""

    def __init__(self, limit_s: float | None):
        self.limit_s = limit_s

    def __enter__(self):
        if self.limit_s is None:
            return self
        end = time.monotonic() + self.limit_s

        def trace(frame, event, arg):
            if time.monotonic() > end:
                raise _TemplateTimeout()
            return trace

        self._previous = sys.gettrace()
        sys.settrace(trace)
        return self

    def __exit__(self, *exc):
        if self.limit_s is not None:
            sys.settrace(self._previous)
        return False


def read_chat_template(chat_template: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the template itself when it reads as Jinja (as vLLM takes it)."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    raise ParamError("chat_template", f"{chat_template!r} is neither a file nor a Jinja template")
