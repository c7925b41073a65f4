"""Llama 3.1/3.2 JSON format: ``{"name": ..., "parameters": {...}}`` as the whole answer,
optionally after ``<|python_tag|>``; several calls are separated by ``;``."""

from __future__ import annotations

import json
from typing import Any

from kvflow.runtime.server.parsers.base import (
    ParsedToolCalls,
    ToolCallItem,
    ToolCallParser,
    held_suffix,
)

__all__ = ["Llama3ToolCallParser"]

_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3ToolCallParser(ToolCallParser):
    def parse(self, text: str) -> ParsedToolCalls:
        start = self.call_start(text)
        if start is None:
            return ParsedToolCalls(text, [])
        pos = start + len(_TAG) if text.startswith(_TAG, start) else start
        calls: list[ToolCallItem] = []
        while True:
            pos = _skip(text, pos, " \t\r\n;")
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                break
            call = ToolCallItem.from_json(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = end
        if not calls:
            return ParsedToolCalls(text, [])
        return ParsedToolCalls((text[:start] + text[pos:]).strip(), calls)

    def call_start(self, text: str) -> int | None:
        tag = text.find(_TAG)
        if tag >= 0:
            return tag
        stripped = len(text) - len(text.lstrip())
        return stripped if text[stripped:].startswith("{") else None

    def hold_from(self, text: str) -> int:
        if not text.strip():
            return 0  # the answer may still open with "{"
        return held_suffix(text, _TAG)

    def render_calls(self, calls: list[ToolCallItem]) -> str:
        return "; ".join(
            f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls
        )

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=2, ensure_ascii=False) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n"
            f"{listed}"
        )


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
