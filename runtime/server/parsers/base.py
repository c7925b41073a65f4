"""Contracts of the output parsers: a tool-call format and a reasoning format."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

__all__ = ["ParsedToolCalls", "ReasoningParser", "ToolCallItem", "ToolCallParser", "held_suffix"]


@dataclass(frozen=True)
class ToolCallItem:
    """One function call: its name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str

    @classmethod
    def from_json(cls, obj: Any, args_keys: tuple[str, ...]) -> ToolCallItem | None:
        """From ``{"name": ..., <args key>: {...}}``; None if ``obj`` is not such a call."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args: Any = next((obj[k] for k in args_keys if k in obj), {})
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return cls(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True)
class ParsedToolCalls:
    """A whole output split into the text outside calls and the calls, in order."""

    content: str
    calls: list[ToolCallItem]


class ToolCallParser(ABC):
    """One model family's tool-call text format.

    ``parse`` never raises: text that looks like a call but does not parse stays content.
    ``call_start`` / ``hold_from`` drive streaming (see :class:`~.stream.ToolCallStream`):
    text before ``hold_from`` can be sent as content at once, because no call can start
    before it.
    """

    @abstractmethod
    def parse(self, text: str) -> ParsedToolCalls:
        """Split a finished output into content and calls."""

    @abstractmethod
    def call_start(self, text: str) -> int | None:
        """Where the first call begins in ``text`` (the output so far), or None."""

    @abstractmethod
    def hold_from(self, text: str) -> int:
        """The earliest position where a call may still begin once more text arrives."""

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
