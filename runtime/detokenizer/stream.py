"""Output text of one request as it streams: stop strings trimmed, never half-emitted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.runtime.detokenizer.incremental import IncrementalDetokenizer

__all__ = ["TextStream", "find_stop"]


def find_stop(text: str, stops: Sequence[str], search_from: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends at or after ``search_from``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, search_from - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


class TextStream:
    """Turns output token ids into text deltas for a client.

    While generating, a tail that could be the start of a stop string is held back, so a
    stop string is never partly streamed. :meth:`finish` emits the rest, cut before the
    matched stop string (if the request stopped on one) and without a matched stop token.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stops: Sequence[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stops = tuple(stops)
        self.emitted = 0

    @property
    def text(self) -> str:
        return self.detok.text[: self.emitted]

    def _holdback(self, text: str) -> int:
        for size in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0

    def push(self, new_ids: Sequence[int]) -> str:
        self.detok.push(new_ids)
        text = self.detok.text
        hit = find_stop(text, self.stops, self.emitted)
        end = hit[0] if hit else len(text) - self._holdback(text)
        return self._emit_to(max(end, self.emitted))

    def finish(self, last_ids: Sequence[int] = (), matched_stop: int | str | None = None) -> str:
        ids = list(last_ids)
        if isinstance(matched_stop, int) and ids and ids[-1] == matched_stop:
            ids = ids[:-1]  # a stop token is not part of the text
        self.detok.push(ids)
        self.detok.flush()
        text = self.detok.text
        end = len(text)
        if self.stops:
            hit = find_stop(text, self.stops, self.emitted)
            if hit:
                end = hit[0]
        return self._emit_to(max(end, self.emitted))

    def _emit_to(self, end: int) -> str:
        delta = self.detok.text[self.emitted : end]
        self.emitted = end
        return delta
