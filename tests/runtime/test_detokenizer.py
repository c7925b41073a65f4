"""Incremental detokenization across split multi-byte characters, and stop-string trimming."""

from __future__ import annotations

import pytest

from kvflow.runtime.detokenizer import IncrementalDetokenizer, TextStream

TEXTS = ["Hello 👋 world 🌍!", "東京は日本の首都です。", "mixed: café ✨ 漢字 and 🧑‍🚀 done"]


def stream_by_token(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = stream_by_token(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces), "half a character was emitted"


def test_emoji_really_spans_several_tokens(tokenizer):
    ids = tokenizer.encode("👋")
    assert len(ids) > 1  # otherwise the test above proves nothing
    assert "\ufffd" in tokenizer.decode(ids[:1])


def test_stop_string_is_trimmed_and_never_streamed(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    stream = TextStream(tokenizer, [], stops=["END"])
    streamed = "".join(stream.push([i]) for i in ids)
    assert "E" not in streamed.split("42.")[1]  # nothing of the stop string leaked
    streamed += stream.finish([], "END")
    assert streamed == "The answer is 42. "


def test_stop_token_is_excluded_from_text(tokenizer):
    ids = tokenizer.encode("Paris")
    stream = TextStream(tokenizer, [], stops=[])
    assert stream.finish([*ids, 2], 2) == "Paris"
