"""Tokenizer loading and chat templates (transformers' fast tokenizers; imported lazily)."""

from __future__ import annotations

import json
import os
import sys
import time

from engine.errors import ParamError

# Template variables the server sets itself; a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "add_generation_prompt", "tokenize",
                                      "return_dict", "chat_template", "tools", "documents"})


def load_tokenizer(path: str, chat_template: str | None = None):
    """The tokenizer of a checkpoint directory; `chat_template` (the template's text) replaces its own. A directory
    transformers cannot read a tokenizer from is a ValueError naming it (transformers' own message does not)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **_known_class_kwargs(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {path!r} could not be loaded: {type(e).__name__}: {e}") from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _known_class_kwargs(path: str) -> dict:
    """AutoTokenizer reads the model's config to pick the tokenizer class, and importing the model's config class
    imports much of transformers' modelling code (torch.distributed.tensor, sympy: seconds of a cold start, most of
    the tokenizer's load). Where tokenizer_config.json names its class and asks for no remote code, the choice needs
    only the config's model type: a plain config that carries it picks the same class. Otherwise: no shortcut."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tokenizer_config = json.load(f)
        model_type = None
        if os.path.exists(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return {}
    if (not isinstance(tokenizer_config, dict) or not isinstance(tokenizer_config.get("tokenizer_class"), str)
            or "auto_map" in tokenizer_config or not isinstance(model_type, (str, type(None)))):
        return {}
    from transformers import PretrainedConfig

    config = PretrainedConfig(name_or_path=path)
    config.model_type = model_type
    return {"config": config}


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, time_limit_s: float | None = None, **kwargs) -> str:
    """Renders a conversation to prompt text with the tokenizer's template (or `chat_template`). Raises ParamError
    on bad messages, a template that rejects them, or one that runs past `time_limit_s`."""
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
                                                 chat_template=chat_template, **kwargs)
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
