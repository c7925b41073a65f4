"""Deterministic prompts of fixed token length, cut from real English text.

The text is the Python reference manual that every CPython ships (``pydoc_data.topics``),
whitespace-collapsed and tokenized once with the served model's own tokenizer. A
:class:`Corpus` hands out disjoint token windows in order, so every run of a benchmark gets
prompts no other run has seen (a radix cache cannot carry hits from one run to the next)
while every server gets the very same prompts.

    corpus:  [ win 0 | win 1 | win 2 | ... ]   take() advances the cursor, never rewinds
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

from tokenizers import Tokenizer

__all__ = ["Corpus", "Prompt", "fixed_length_prompts", "shared_prefix_prompts"]


@dataclass(frozen=True)
class Prompt:
    """One request's input: a ``prefix`` (shared system text, may be empty) and a ``suffix``.

    Completions send ``prefix + suffix`` as the prompt; chat sends the prefix as the system
    message and the suffix as the user message.
    """

    prefix: str
    suffix: str

    @property
    def text(self) -> str:
        return self.prefix + self.suffix


class Corpus:
    """The reference manual as one token stream, cut into windows on demand."""

    # How far a window may slide to find text that re-encodes to exactly its length.
    _MAX_SHIFT = 16

    def __init__(self, tokenizer_file: str | Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        text = "\n\n".join(" ".join(topics[key].split()) for key in sorted(topics))
        self.token_ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        self.cursor = 0

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def take(self, num_tokens: int) -> str:
        """Text of the next window that re-encodes to ``num_tokens`` tokens where possible."""
        best = ""
        for shift in range(self._MAX_SHIFT):
            start = self.cursor + shift
            if start + num_tokens > len(self.token_ids):
                raise ValueError(f"corpus exhausted: {len(self.token_ids)} tokens, need more")
            best = self.tokenizer.decode(self.token_ids[start : start + num_tokens])
            if self.count_tokens(best) == num_tokens:
                break
        self.cursor = start + num_tokens
        return best


def fixed_length_prompts(corpus: Corpus, count: int, input_len: int) -> list[Prompt]:
    """``count`` distinct prompts of ``input_len`` tokens each (no shared prefix)."""
    return [Prompt("", corpus.take(input_len)) for _ in range(count)]


def shared_prefix_prompts(
    corpus: Corpus, count: int, num_groups: int, prefix_len: int, question_len: int
) -> list[Prompt]:
    """``count`` prompts in ``num_groups`` groups; a group shares a ``prefix_len``-token prefix.

    Request ``i`` belongs to group ``i % num_groups``, so concurrent clients touch every
    group at once; each request's question (``question_len`` tokens of text) is distinct.
    """
    prefixes = [corpus.take(prefix_len) + "\n\n" for _ in range(num_groups)]
    return [
        Prompt(
            prefixes[i % num_groups],
            f'Question {i}: what does the text above say about "{corpus.take(question_len)}"?\nAnswer:',
        )
        for i in range(count)
    ]
