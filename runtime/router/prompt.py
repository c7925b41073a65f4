"""The routing key of a request: its prompt as one string, for the prefix trees.

Chat requests concatenate their messages' text contents; completions take the prompt text
or token ids; ``/generate`` takes ``text`` or ``input_ids``. For a batch, the first item
stands for the request. Token ids become one character each (offset into a private-use
plane, after a marker that keeps them apart from text), so one tree type serves both.
"""

from __future__ import annotations

import json
from typing import Any

from kvflow.runtime.wire import RequestError

__all__ = ["parse_body", "routing_key"]

_IDS_MARKER = "\x00"
_IDS_OFFSET = 0xF0000  # supplementary private use area: ids up to 65533 stay in it
_MAX_CHAR = 0x10FFFF


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object, or a 400 from the router itself."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(400, f"malformed JSON: {err}") from err
    if not isinstance(payload, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return payload


def _ids_key(ids: list[Any]) -> str:
    chars = [_IDS_MARKER]
    for token in ids:
        if isinstance(token, int):
            chars.append(chr(_IDS_OFFSET + token % (_MAX_CHAR - _IDS_OFFSET + 1)))
    return "".join(chars)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _prompt_key(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return _ids_key(prompt)
        return _prompt_key(first)  # a batch: its first prompt
    return ""


def routing_key(path: str, payload: dict[str, Any]) -> str:
    """The string the cache-aware trees match and learn; empty when there is none."""
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
    if path == "/v1/completions":
        return _prompt_key(payload.get("prompt"))
    if path == "/generate":
        if payload.get("text") is not None:
            return _prompt_key(payload.get("text"))
        return _prompt_key(payload.get("input_ids"))
    return ""
