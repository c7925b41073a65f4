"""Llama 3.1/3.2 JSON format: ``{"name": ..., "parameters": {...}}`` as the whole answer,
optionally after ``<|python_tag|>``; several calls are separated by ``;``."""

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

__all__ = ["Llama3ToolCallParser"]

_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")


class Llama3ToolCallParser(ToolCallParser):
    """The calls start where the answer opens with ``{`` (after whitespace) or right after
    ``<|python_tag|>``; after the last call, the rest is text. If the first does not turn
    out to be a call, the whole answer is text."""

    def split(self, text: str, final: bool) -> list[OutputPart]:
        lead = skip(text, 0)
        if lead == len(text):  # only whitespace: the answer may still open with "{"
            return [text] if final and text else []
        if text[lead] == "{":
            pos = lead
        else:
            tag = text.find(_TAG)
            if tag < 0:
                end = len(text) if final else held_suffix(text, _TAG)
                return [text[:end]] if end else []
            lead, pos = tag, tag + len(_TAG)
        parts: list[OutputPart] = [text[:lead]] if lead else []
        while True:
            pos = skip(text, pos, " \t\r\n;")
            scan = scan_call(text, pos, _ARGS_KEYS)
            if scan.state == "undecided" and not final:
                return parts  # held until decided
            if scan.state != "call":
                if not any(isinstance(p, ToolCallItem) for p in parts):
                    return [text]  # the first is not a call: the whole answer is text
                rest = text[pos:]
                return [*parts, rest] if rest else parts
            parts.append(scan.item())
            if scan.end is None:
                return parts  # its arguments are still arriving
            pos = scan.end

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
