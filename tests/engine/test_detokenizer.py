"""Incremental detokenization against the tiny model's real byte-level BPE tokenizer."""

import pytest

from engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! How are you?", "naïve café — 東京 🙂 ok", "  spaces\n\tand tabs  ", "def f(x):\n    return x"]


@pytest.fixture(params=[True, False], ids=["decode-stream", "window"])
def use_stream(request):
    return request.param


def stream(tokenizer, text, use_stream=True, **kw):
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id], use_stream=use_stream, **kw)
    deltas = []
    for i, token_id in enumerate(ids):
        stop = det.update([token_id])
        deltas.append(det.flush(is_finished=stop is not None or i == len(ids) - 1))
        if stop:
            break
    return det, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tiny_tokenizer, text, use_stream):
    det, deltas = stream(tiny_tokenizer, text, use_stream)
    assert det.output_text == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # never a half character


def test_multibyte_character_spans_tokens(tiny_tokenizer, use_stream):
    ids = tiny_tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is several byte tokens in this vocabulary
    det = IncrementalDetokenizer(tiny_tokenizer, [1], use_stream=use_stream)
    for token_id in ids[:-1]:
        det.update([token_id])
        assert det.output_text == ""
    det.update(ids[-1:])
    assert det.output_text == "🙂"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tiny_tokenizer, include, use_stream):
    text = "The quick brown fox jumps over the lazy dog."
    det, deltas = stream(tiny_tokenizer, text, use_stream, stop=["fox jum"], include_stop_str_in_output=include)
    assert det.stop_reason == "fox jum"
    expected = "The quick brown fox jum" if include else "The quick brown "
    assert det.output_text == expected
    assert "".join(deltas) == expected  # the held-back tail never leaked the stop string


def test_earliest_stop_string_wins(tiny_tokenizer):
    det, _ = stream(tiny_tokenizer, "one two three four", stop=["four", "two"])
    assert det.stop_reason == "two" and det.output_text == "one "


def test_special_tokens_skipped_or_kept(tiny_tokenizer, use_stream):
    eos = tiny_tokenizer.eos_token_id
    ids = tiny_tokenizer.encode("Hi", add_special_tokens=False) + [eos]
    skip = IncrementalDetokenizer(tiny_tokenizer, [1], skip_special_tokens=True, use_stream=use_stream)
    keep = IncrementalDetokenizer(tiny_tokenizer, [1], skip_special_tokens=False, use_stream=use_stream)
    skip.update(ids)
    keep.update(ids)
    assert skip.output_text == "Hi" and keep.output_text == "Hi" + tiny_tokenizer.eos_token
