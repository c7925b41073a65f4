"""Reads a chat answer back per its :class:`ChatPlan`: ``content``, ``reasoning_content`` and
``tool_calls`` (OpenAI's shapes), whole or as streamed deltas."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvflow.runtime.server.openai.chat_plan import ChatPlan
from kvflow.runtime.server.parsers import (
    ReasoningStream,
    StreamDelta,
    ToolCallItem,
    ToolCallStream,
)

__all__ = ["ChatOutputStream", "shape_message"]


def _call_dict(call: ToolCallItem, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


def _forced_calls(text: str) -> list[ToolCallItem]:
    """The call list of a constrained (required/named) answer; [] if it did not complete
    (cut off by max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    calls = [ToolCallItem.from_json(item, ("parameters", "arguments")) for item in items]
    return [c for c in calls if c is not None]


def _finish(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def shape_message(
    plan: ChatPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole answer, and its finish reason."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.reasoning is not None:
        reasoning, text = plan.reasoning.parse(text)
        message["reasoning_content"] = reasoning
        message["content"] = text
    calls: list[ToolCallItem] = []
    if plan.forced_calls:
        calls = _forced_calls(text)
        if calls:
            message["content"] = None
    elif plan.tool_parser is not None:
        parsed = plan.tool_parser.parse(text)
        calls = parsed.calls[:1] if not plan.parallel_tool_calls else parsed.calls
        if calls:
            message["content"] = parsed.content or None
    if calls:
        message["tool_calls"] = [_call_dict(c) for c in calls]
    return message, _finish(finish_reason, calls)


class ChatOutputStream:
    """One sample's deltas: ``feed`` each text delta, then ``finish`` with the finish reason."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.reasoning = (
            ReasoningStream(plan.reasoning, plan.stream_reasoning) if plan.reasoning else None
        )
        self.tools = ToolCallStream(plan.tool_parser) if plan.tool_parser else None
        self.forced_text = ""
        self.calls_sent = 0

    def feed(self, text: str) -> dict[str, Any]:
        return self._delta(self._split(text, final=False))

    def finish(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        delta = self._delta(self._split("", final=True))
        return delta, _finish(finish_reason, [None] * self.calls_sent)

    def _split(self, text: str, final: bool) -> StreamDelta:
        out = StreamDelta(content=text)
        if self.reasoning is not None:
            out = self.reasoning.finish() if final else self.reasoning.feed(text)
        content, out.content = out.content, ""
        if self.plan.forced_calls:
            self.forced_text += content
            if final:
                out.calls = _forced_calls(self.forced_text)
                if not out.calls:  # cut off: what it wrote is all there is
                    out.content = self.forced_text
        elif self.tools is not None:
            part = self.tools.feed(content)
            if final:
                part = _merge(part, self.tools.finish())
            out.content, out.calls = part.content, part.calls
            if not self.plan.parallel_tool_calls:
                out.calls = out.calls[: max(1 - self.calls_sent, 0)]
        else:
            out.content = content
        return out

    def _delta(self, part: StreamDelta) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if part.reasoning:
            delta["reasoning_content"] = part.reasoning
        if part.content:
            delta["content"] = part.content
        if part.calls:
            delta["tool_calls"] = [
                _call_dict(c, self.calls_sent + i) for i, c in enumerate(part.calls)
            ]
            self.calls_sent += len(part.calls)
        return delta


def _merge(first: StreamDelta, second: StreamDelta) -> StreamDelta:
    return StreamDelta(
        content=first.content + second.content,
        reasoning=first.reasoning + second.reasoning,
        calls=first.calls + second.calls,
    )
