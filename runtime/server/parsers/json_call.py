"""Reading JSON function-call objects (``{"name": ..., "arguments": {...}}``) while their
text is still arriving, so a call can be streamed before it is complete.

:func:`scan_call` reads one call object from the text so far and says whether it is one:

- ``undecided``: it may still become a call (or not);
- ``call``: its ``name`` is complete and its arguments have begun (or the whole object is
  complete and valid JSON without arguments, which means ``{}``). From here on it stays a
  call whatever follows, so a stream may send it;
- ``invalid``: it cannot be a call.

A call's ``arguments`` are the arguments object's own text as the model wrote it (OpenAI
gives them so), growing as the text grows: what a stream sent is always a prefix of what
it will send. Arguments written as a JSON string (``"arguments": "{\\"a\\": 1}"``) are
its decoded text, given once the string is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from kvflow.runtime.server.parsers.base import OutputPart, ToolCallItem

__all__ = ["CallScan", "scan_call", "skip", "split_call_list"]

_WS = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"


@dataclass(frozen=True)
class CallScan:
    state: Literal["undecided", "call", "invalid"]
    name: str | None = None
    arguments: str = ""  # the arguments' text so far (state "call")
    end: int | None = None  # just past the object's closing brace, once complete

    def item(self) -> ToolCallItem:
        assert self.name is not None
        return ToolCallItem(self.name, self.arguments)


_UNDECIDED = CallScan("undecided")
_INVALID = CallScan("invalid")


def skip(text: str, pos: int, chars: str = _WS) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Just past the JSON string opening at ``pos``; None if incomplete, -1 if invalid."""
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
        elif ch == '"':
            return i + 1
        elif ord(ch) < 0x20:
            return -1
        else:
            i += 1
    return None


def _value_end(text: str, pos: int) -> int | None:
    """Just past the JSON value starting at ``pos`` (brackets and strings matched, scalars
    read to their delimiter); None if incomplete, -1 if it cannot be a value."""
    ch = text[pos]
    if ch == '"':
        return _string_end(text, pos)
    if ch not in "{[":
        end = pos
        while end < len(text) and text[end] not in _SCALAR_END:
            end += 1
        if end == len(text):
            return None
        return end if end > pos else -1
    depth, i = 0, pos
    while i < len(text):
        ch = text[i]
        if ch == '"':
            string_end = _string_end(text, i)
            if string_end is None or string_end < 0:
                return string_end
            i = string_end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _decode(token: str) -> object:
    try:
        return json.loads(token)
    except json.JSONDecodeError:
        return _INVALID


def scan_call(text: str, pos: int, args_keys: tuple[str, ...]) -> CallScan:
    """The call object that starts at ``text[pos]`` (``{``), read as far as ``text`` goes;
    the first of ``args_keys`` present holds the arguments."""
    n = len(text)
    if pos >= n:
        return _UNDECIDED
    if text[pos] != "{":
        return _INVALID
    name: str | None = None
    args: str | None = None
    p, first = pos + 1, True
    while True:
        p = skip(text, p)
        if p >= n:
            break
        if text[p] == "}":
            return _complete(text, pos, p + 1, name, args)
        if not first:
            if text[p] != ",":
                return _INVALID
            p = skip(text, p + 1)
            if p >= n:
                break
        first = False
        if text[p] != '"':
            return _INVALID
        key_end = _string_end(text, p)
        if key_end is None:
            break
        key = _decode(text[p:key_end]) if key_end > 0 else _INVALID
        if not isinstance(key, str):
            return _INVALID
        p = skip(text, key_end)
        if p >= n:
            break
        if text[p] != ":":
            return _INVALID
        p = skip(text, p + 1)
        if p >= n:
            break
        if key == "name" and name is None:
            if text[p] != '"':
                return _INVALID
            end = _string_end(text, p)
            if end is None:
                break
            value = _decode(text[p:end]) if end > 0 else _INVALID
            if not isinstance(value, str):
                return _INVALID
            name, p = value, end
        elif key in args_keys and args is None:
            if text[p] not in '{"':
                return _INVALID
            end = _value_end(text, p)
            if end is None:
                if text[p] == "{":
                    args = text[p:]  # arriving: all of it is the arguments' text
                break
            if end < 0:
                return _INVALID
            if text[p] == "{":
                args = text[p:end]
            else:  # a JSON string holding the arguments object's text
                decoded = _decode(text[p:end])
                if not isinstance(decoded, str) or not isinstance(_decode(decoded), dict):
                    return _INVALID
                args = decoded
            p = end
        else:
            end = _value_end(text, p)
            if end is None:
                break
            if end < 0:
                return _INVALID
            p = end
    if name is not None and args is not None:
        return CallScan("call", name, args)
    return _UNDECIDED


def _complete(text: str, start: int, end: int, name: str | None, args: str | None) -> CallScan:
    if name is not None and args is not None:
        return CallScan("call", name, args, end)  # a call since its arguments began
    if name is None or not isinstance(_decode(text[start:end]), dict):
        return _INVALID
    return CallScan("call", name, "{}", end)


def split_call_list(text: str, final: bool) -> list[OutputPart]:
    """A JSON list of calls ``[{"name": ..., "parameters": {...}}, ...]`` (the answer to a
    ``required`` or named ``tool_choice``, constrained by its grammar): its calls so far;
    the whole text as content if it ended before any call began (cut off)."""
    parts: list[OutputPart] = []
    p = skip(text, 0)
    if p < len(text) and text[p] == "[":
        p += 1
        while True:
            p = skip(text, p)
            if p < len(text) and parts and text[p] == ",":
                p = skip(text, p + 1)
            scan = scan_call(text, p, ("parameters", "arguments"))
            if scan.state != "call":
                break
            parts.append(scan.item())
            if scan.end is None:
                break
            p = scan.end
    if final and not parts and text:
        return [text]
    return parts
