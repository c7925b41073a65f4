"""Hermes / Qwen 2.5 format: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
from typing import Any

from kvflow.runtime.server.parsers.base import (
    OutputPart,
    ToolCallItem,
    ToolCallParser,
    held_suffix,
)
from kvflow.runtime.server.parsers.json_call import scan_call, skip

__all__ = ["HermesToolCallParser"]

_START, _END = "<tool_call>", "</tool_call>"
_ARGS_KEYS = ("arguments", "parameters")


class HermesToolCallParser(ToolCallParser):
    def split(self, text: str, final: bool) -> list[OutputPart]:
        parts: list[OutputPart] = []
        pos = 0
        while True:
            start = text.find(_START, pos)
            if start < 0:
                end = len(text) if final else max(held_suffix(text, _START), pos)
                return _with(parts, text[pos:end])
            _with(parts, text[pos:start])
            scan = scan_call(text, skip(text, start + len(_START)), _ARGS_KEYS)
            if scan.state == "invalid" or (scan.state == "undecided" and final):
                return _with(parts, text[start:])  # not a call: the rest is text
            if scan.state == "undecided":
                return parts  # held until decided
            parts.append(scan.item())
            if scan.end is None:
                return parts  # its arguments are still arriving
            after = skip(text, scan.end)
            if text.startswith(_END, after):
                pos = skip(text, after + len(_END))
            elif not final and _END.startswith(text[after:]):
                return parts  # the end marker may be arriving
            else:  # no end marker: what follows the call is text
                pos = after

    def render_calls(self, calls: list[ToolCallItem]) -> str:
        return "\n".join(
            f'{_START}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{_END}'
            for c in calls
        )

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You may call one or more functions to answer the user. The functions are given "
            f"as JSON schemas within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments within "
            f'{_START}{_END} tags:\n{_START}\n{{"name": <function-name>, '
            f'"arguments": <arguments-json-object>}}\n{_END}'
        )


def _with(parts: list[OutputPart], content: str) -> list[OutputPart]:
    if content:
        parts.append(content)
    return parts
