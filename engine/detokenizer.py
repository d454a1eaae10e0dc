"""Incremental detokenization and stop strings, on the driver.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character can span tokens, and some
tokenizers change how a token prints depending on what comes before it. So each step decodes a short window of
tokens twice, with and without the new ones, and emits the difference once it no longer ends in a partial
character (U+FFFD).

Stop strings may also span tokens. The detokenizer keeps the whole text, searches only the tail that the new text
could complete, and holds back the last `max(len(stop)) - 1` characters from a stream until they can no longer
start a stop string.
"""

from __future__ import annotations

_WINDOW_TOKENS = 6  # tokens of left context re-decoded with each step


def _make_stream(tokenizer, prompt_tail: list[int], skip_special_tokens: bool):
    """The `tokenizers` library's own incremental decoder (Rust, ~1 us a token), seeded with the prompt's tail so
    that context-dependent tokens print right; None when unavailable (then the window method below is used)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return backend, DecodeStream(ids=list(prompt_tail), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 use_stream: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_buffer_chars = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prompt_tail = list(prompt_token_ids[-_WINDOW_TOKENS:])  # context for the first output tokens
        self.prefix_offset = 0  # into context + token_ids: window start
        self.read_offset = len(self.prompt_tail)  # tokens before this are already in `text`
        self.text = ""
        self.num_streamed_chars = 0
        self.num_checked_chars = 0
        self.stop_reason: str | None = None
        self.stream = _make_stream(tokenizer, self.prompt_tail, skip_special_tokens) if use_stream else None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string if one now ends the text (the text is then truncated)."""
        if self.stream is not None and not self.stop:  # (a verify step's several tokens: one append of their text)
            backend, stream = self.stream
            self.token_ids += new_token_ids
            self.text += "".join([chunk for token_id in new_token_ids if (chunk := stream.step(backend, token_id))])
            return None
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._decode_next()
            stop = self._check_stop()
            if stop is not None:
                self.stop_reason = stop
                return stop
        return None

    def _decode_next(self) -> None:
        if self.stream is not None:
            backend, stream = self.stream
            chunk = stream.step(backend, self.token_ids[-1])
            if chunk:
                self.text += chunk
            return
        ids = self.prompt_tail + self.token_ids
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        full = self._decode(ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = max(self.read_offset - _WINDOW_TOKENS, 0)
            self.read_offset = len(ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _check_stop(self) -> str | None:
        if not self.stop:
            return None
        # Only the tail can hold a stop string that the last token completed.
        search_from = max(self.num_checked_chars - self.stop_buffer_chars, 0)
        self.num_checked_chars = len(self.text)
        best = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[:index + len(stop)] if self.include_stop_str_in_output else self.text[:index]
        return stop

    def stable_text(self, is_finished: bool) -> str:
        """The text that can be shown: while unfinished, without the tail that a stop string completed by a later
        token could still cut away. It only grows (a stop string never starts inside what was shown)."""
        if is_finished or not self.stop:
            return self.text
        return self.text[:max(len(self.text) - self.stop_buffer_chars, 0)]

    def flush(self, is_finished: bool) -> str:
        """New stable text since the last call."""
        text = self.stable_text(is_finished)
        delta = text[self.num_streamed_chars:]
        self.num_streamed_chars = max(len(text), self.num_streamed_chars)
        return delta

    @property
    def output_text(self) -> str:
        return self.text
