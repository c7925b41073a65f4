"""Logprob ``bytes`` are each token's own bytes, also for partial UTF-8 characters."""

from __future__ import annotations

import pytest

from kvflow.runtime.tokenizer import TokenBytes


@pytest.mark.parametrize("text", ["Hello 🙂 naïve 日本語 ✓", "Ω≈ç√∫", "plain ascii"])
def test_token_bytes_concatenate_to_the_text(tokenizer, text):
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(text)
    assert b"".join(token_bytes.of(i) for i in ids) == text.encode()


def test_partial_characters_are_not_the_replacement_character(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    partial = [i for i in tokenizer.encode("日本語") if "\ufffd" in tokenizer.decode([i])]
    assert partial, "the test needs a token that is part of a character"
    for token_id in partial:
        assert token_bytes.of(token_id) != "\ufffd".encode()
