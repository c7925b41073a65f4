"""Hermes / Qwen 2.5 format: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
from typing import Any

from kvflow.runtime.server.parsers.base import (
    ParsedToolCalls,
    ToolCallItem,
    ToolCallParser,
    held_suffix,
)

__all__ = ["HermesToolCallParser"]

_START, _END = "<tool_call>", "</tool_call>"


class HermesToolCallParser(ToolCallParser):
    def parse(self, text: str) -> ParsedToolCalls:
        calls: list[ToolCallItem] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(_START, pos)) >= 0:
            end = text.find(_END, start)
            body = text[start + len(_START) : end if end >= 0 else len(text)]
            call = _call(body)
            if call is None:  # not a call after all: keep it as text
                break
            content.append(text[pos:start])
            calls.append(call)
            pos = len(text) if end < 0 else end + len(_END)
        content.append(text[pos:])
        return ParsedToolCalls("".join(content).strip() if calls else text, calls)

    def call_start(self, text: str) -> int | None:
        start = text.find(_START)
        return None if start < 0 else start

    def hold_from(self, text: str) -> int:
        return held_suffix(text, _START)

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


def _call(body: str) -> ToolCallItem | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    return ToolCallItem.from_json(obj, ("arguments", "parameters"))
