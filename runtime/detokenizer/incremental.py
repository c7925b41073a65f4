"""Token ids in, text out, one step at a time, never emitting half a character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens kept as decoding context, so the first output token gets its leading
# space right with tokenizers that drop it at the start of a string.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing id sequence; :meth:`push` returns only completed new text.

    A byte-level token can end in the middle of a UTF-8 character (emoji, CJK); decoding
    then ends in U+FFFD. Such text is held back until a later token completes it, by
    decoding a window ``ids[prefix_offset:]`` and emitting what follows the decode of
    ``ids[prefix_offset:read_offset]``.
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is pending, even an incomplete character."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
