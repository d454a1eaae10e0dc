"""Tokenizer loading and chat templates (transformers' fast tokenizers; imported lazily)."""

from __future__ import annotations

import os


def load_tokenizer(path: str, chat_template: str | None = None):
    """The tokenizer of a checkpoint directory; `chat_template` (the template's text) replaces its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, **kwargs) -> str:
    """Renders a conversation to prompt text with the tokenizer's template. Raises ValueError on bad messages."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("each message needs a 'role'")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **kwargs)
    except Exception as e:  # jinja errors: the template rejected the conversation
        raise ValueError(f"chat template failed: {e}") from e


def read_chat_template(chat_template: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the template itself when it reads as Jinja (as vLLM takes it)."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    raise ValueError(f"chat_template {chat_template!r} is neither a file nor a Jinja template")
