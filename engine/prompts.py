"""Prompt validation: text or token ids -> token ids within the model's limits, or a ParamError.

A function of the model's limits, so a process without the engine (a Serve replica whose engine runs in another
process) validates requests exactly as the engine would.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ParamError
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_chars_per_token: int  # the longest token's text: no prompt longer than max_model_len of them can fit

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.max_chars_per_token


def longest_token_chars(tokenizer) -> int:
    """An upper bound of the text one token covers: the longest token as the vocabulary spells it (byte-level BPE
    and SentencePiece spell a token with at least as many characters as its text has)."""
    return max(map(len, tokenizer.get_vocab()), default=1) + 1


def prompt_limits(tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int) -> PromptLimits:
    return PromptLimits(vocab_size, max_model_len, max_num_seqs, longest_token_chars(tokenizer))


def process_prompt(prompt: Prompt, params: SamplingParams, tokenizer, limits: PromptLimits,
                   ) -> tuple[str | None, list[int]]:
    """Validates a prompt and its params against a model; returns (text, token ids). Raises ParamError."""
    add_special_tokens = True
    if isinstance(prompt, dict):
        add_special_tokens = bool(prompt.get("add_special_tokens", True))
        if "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            text, token_ids = prompt["prompt"], None
        else:
            raise ParamError("prompt", "dict needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text, token_ids = prompt, None
    elif isinstance(prompt, (list, tuple)):
        text, token_ids = None, list(prompt)
    else:
        raise ParamError("prompt", f"must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    truncate, special_prefix = params.truncate_prompt_tokens, []
    if token_ids is None:
        if not isinstance(text, str):
            raise ParamError("prompt", "must be a string")
        if truncate is None and len(text) > limits.max_prompt_chars:  # cannot fit, whatever the tokenizer makes
            raise _too_long(f"{len(text)} characters, more than {limits.max_model_len} tokens can hold", limits)
        token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if truncate is not None and add_special_tokens:
            special_prefix = tokenizer.encode("", add_special_tokens=True)  # a BOS the tokenizer puts first
    if not token_ids:
        raise ParamError("prompt", "is empty")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size for t in token_ids):
        raise ParamError("prompt", f"token ids must be integers in [0, {limits.vocab_size})")
    if truncate is not None:
        kept = truncated_length(truncate, params.max_tokens, limits.max_model_len)
        if len(token_ids) > kept:  # the last tokens, as vLLM keeps them (left truncation)
            text, token_ids = None, _keep_last(token_ids, kept, special_prefix)
    if len(token_ids) >= limits.max_model_len:
        raise _too_long(f"{len(token_ids)} tokens", limits)
    params.validate()
    params.validate_for_model(limits.vocab_size)
    if params.n > limits.max_num_seqs:
        raise ParamError("n", f"must be at most max_num_seqs={limits.max_num_seqs}, got {params.n}")
    return text, token_ids


def truncated_length(truncate_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """How many prompt tokens truncate_prompt_tokens keeps at most: k, or with -1 what the context holds beside
    max_tokens (at least one output token). A k that cannot fit beside max_tokens is a ParamError, as in vLLM."""
    room = max_model_len - (max_tokens or 1)
    if truncate_prompt_tokens == -1:
        if room < 1:
            raise ParamError("max_tokens", f"is too large: this model's maximum context length is {max_model_len} "
                                           "tokens, which leaves no room for the prompt")
        return room
    if truncate_prompt_tokens > room:
        raise ParamError("truncate_prompt_tokens", f"is {truncate_prompt_tokens}, more than the {room} tokens this "
                                                   f"model's context ({max_model_len}) holds beside max_tokens")
    return truncate_prompt_tokens


def _keep_last(token_ids: list[int], kept: int, special_prefix: list[int]) -> list[int]:
    """The last `kept` tokens; a text prompt's special prefix (its BOS) stays first, as a tokenizer's own
    truncation keeps it."""
    n = len(special_prefix)
    if n and n < kept and token_ids[:n] == special_prefix:
        return special_prefix + token_ids[n:][-(kept - n):]
    return token_ids[-kept:]


def _too_long(size: str, limits: PromptLimits) -> ParamError:
    return ParamError("prompt", f"is {size}, but this model's maximum context length is {limits.max_model_len} "
                                f"tokens (prompt and at least one output token)")
