"""Contracts of the output parsers: a tool-call format and a reasoning format."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

__all__ = [
    "OutputPart",
    "ParsedToolCalls",
    "ReasoningParser",
    "ToolCallItem",
    "ToolCallParser",
    "held_suffix",
]


@dataclass(frozen=True)
class ToolCallItem:
    """One function call: its name and its arguments as JSON text (OpenAI's shape), the
    text the model wrote for them."""

    name: str
    arguments: str


# An output read so far: content pieces and calls, in order (see ToolCallParser.split).
OutputPart = str | ToolCallItem


@dataclass(frozen=True)
class ParsedToolCalls:
    """A whole output split into the text outside calls and the calls, in order."""

    content: str
    calls: list[ToolCallItem]


class ToolCallParser(ABC):
    """One model family's tool-call text format.

    :meth:`split` reads an output, whole or so far, into content pieces and calls; it never
    raises: text that is not a call stays content. It is what streaming sends (see
    :class:`~.stream.ToolCallStream`), so it must only ever extend what it gave for a
    shorter text: content that may still turn out to start a call is held back, and a call
    is given once it is decided (its name complete and its arguments begun) with its
    arguments' text so far. :meth:`parse` is the split of a finished output.
    """

    @abstractmethod
    def split(self, text: str, final: bool) -> list[OutputPart]:
        """The parts of ``text``: with ``final`` it is the whole output (nothing held back;
        a call cut off after it began stays a call), else more may follow."""

    def parse(self, text: str) -> ParsedToolCalls:
        """A finished output's calls, and the text outside them (stripped when there are
        calls; the whole text when there are none)."""
        parts = self.split(text, final=True)
        calls = [p for p in parts if isinstance(p, ToolCallItem)]
        if not calls:
            return ParsedToolCalls(text, [])
        content = "".join(p for p in parts if isinstance(p, str))
        return ParsedToolCalls(content.strip(), calls)

    @abstractmethod
    def render_calls(self, calls: list[ToolCallItem]) -> str:
        """How the assistant's earlier calls read in a prompt (this format's own syntax)."""

    @abstractmethod
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system prompt that shows the tools and this format to a model whose chat
        template cannot render tools itself."""


def held_suffix(text: str, marker: str) -> int:
    """The start of the longest suffix of ``text`` that is a proper prefix of ``marker``
    (``len(text)`` when there is none): a marker may be arriving there."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class ReasoningParser:
    """Splits an output into reasoning (``reasoning_content``) and the answer (``content``).

    ``starts_in_reasoning``: the chat template opens the reasoning block itself, so the
    output is reasoning until the end marker even without a start marker.
    """

    start = "<think>"
    end = "</think>"
    starts_in_reasoning = False

    def parse(self, text: str) -> tuple[str | None, str]:
        """``(reasoning or None, content)`` of a finished output."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start) :]
        elif not self.starts_in_reasoning:
            return None, text
        reasoning, found, content = body.partition(self.end)
        # Leading whitespace of each part is dropped, trailing whitespace kept: so the
        # streamed parts (see ReasoningStream) add up to the same strings.
        return reasoning.lstrip(), content.lstrip() if found else ""
