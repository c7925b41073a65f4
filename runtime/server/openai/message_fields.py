"""Which fields kvflow knows inside chat messages and their content parts.

The request-level checks (:mod:`.fields`) stop at ``messages``; this module does the same
one level down, so a field inside a message is never dropped without a word:

- honoured (:data:`MESSAGE_FIELDS`): ``role``, ``content``, ``name``, ``tool_calls``,
  ``tool_call_id``, ``reasoning_content``; ``name`` and ``reasoning_content`` reach the chat
  template as they are (as in SGLang, the template decides whether to render them);
- :data:`MESSAGE_REFUSED_UNLESS_DEFAULT`: defined by OpenAI (``refusal``, ``audio``,
  ``function_call``) or SGLang 0.5.23 (``phase``, ``tools``, ``prefix``) but not
  implemented: accepted at ``null`` (``prefix`` also ``false``), else a 400;
- anything else is a 400 naming it, with the message's index.

Content parts: ``text`` parts (fields ``type`` and ``text``) are honoured; the other part
types OpenAI and SGLang define (images, audio, video, files, thinking, refusal, tool
references) are a 400 that says why; an unknown type or field is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvflow.runtime.wire.errors import RequestError

__all__ = [
    "CONTENT_PART_REFUSED",
    "MESSAGE_FIELDS",
    "MESSAGE_REFUSED_UNLESS_DEFAULT",
    "check_messages",
]

MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
)

_NOT_IMPLEMENTED = "kvflow does not implement it"
# Known, accepted only at one of these values (the default first): name -> (values, why).
MESSAGE_REFUSED_UNLESS_DEFAULT: dict[str, tuple[tuple[Any, ...], str]] = {
    "refusal": ((None,), "give the assistant's earlier answer as content"),
    "audio": ((None,), "this server's model takes and produces text only"),
    "function_call": ((None,), "OpenAI's deprecated form; give tool_calls"),
    "phase": ((None,), _NOT_IMPLEMENTED),
    "tools": ((None,), "give tools on the request"),
    "prefix": ((None, False), "give continue_final_message on the request"),
}

_TEXT_ONLY = "this server's model takes text only"
# Content part types OpenAI or SGLang define that kvflow refuses: type -> why.
CONTENT_PART_REFUSED: dict[str, str] = {
    "image_url": _TEXT_ONLY,
    "input_audio": _TEXT_ONLY,
    "audio_url": _TEXT_ONLY,
    "video_url": _TEXT_ONLY,
    "file": _TEXT_ONLY,
    "thinking": "give the reasoning as the message's reasoning_content",
    "reasoning": "give the reasoning as the message's reasoning_content",
    "refusal": "give the assistant's earlier answer as a text part",
    "tool_reference": _NOT_IMPLEMENTED,
}
_TEXT_PART_FIELDS = frozenset({"type", "text"})


def check_messages(raw: Any) -> Any:
    """The messages without the known fields left at their default; 400 on an unknown or
    refused field of a message or content part. Values that are not objects pass (the
    request model refuses them with its own message)."""
    if not isinstance(raw, list):
        return raw
    return [_check_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


def _check_message(message: Any, where: str) -> Any:
    if not isinstance(message, Mapping):
        return message
    kept = {}
    for name, value in message.items():
        if name in MESSAGE_FIELDS:
            kept[name] = value
            continue
        if name not in MESSAGE_REFUSED_UNLESS_DEFAULT:
            raise RequestError(
                400,
                f"unknown field {where}.{name!r}: neither OpenAI nor SGLang defines it "
                "for a message",
            )
        allowed, why = MESSAGE_REFUSED_UNLESS_DEFAULT[name]
        if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
            raise RequestError(
                400, f"{where}.{name!r} is not supported by kvflow ({why}); leave it out"
            )
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            _check_part(part, f"{where}.content[{j}]")
    return kept


def _check_part(part: Any, where: str) -> None:
    if not isinstance(part, Mapping):
        return
    kind = part.get("type")
    if not isinstance(kind, str):
        raise RequestError(400, f"{where}.'type' must be a string, such as 'text'")
    if kind in CONTENT_PART_REFUSED:
        raise RequestError(
            400,
            f"{where} has type {kind!r}, which kvflow does not support ({CONTENT_PART_REFUSED[kind]})",
        )
    if kind != "text":
        raise RequestError(
            400, f"{where} has an unknown type {kind!r}: neither OpenAI nor SGLang defines it"
        )
    for name in part:
        if name not in _TEXT_PART_FIELDS:
            raise RequestError(
                400,
                f"unknown field {where}.{name!r}: neither OpenAI nor SGLang defines it "
                "for a text part",
            )
    if not isinstance(part.get("text"), str):
        raise RequestError(400, f"{where}.'text' must be a string")
