"""Reads a chat answer back per its :class:`ChatPlan`: ``content``, ``reasoning_content`` and
``tool_calls`` (OpenAI's shapes), whole or as streamed deltas."""

from __future__ import annotations

import uuid
from typing import Any

from kvflow.runtime.server.openai.chat_plan import ChatPlan
from kvflow.runtime.server.parsers import (
    ReasoningStream,
    StreamDelta,
    ToolCallDelta,
    ToolCallItem,
    ToolCallStream,
    split_call_list,
)

__all__ = ["ChatOutputStream", "shape_message"]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _forced_calls(text: str) -> list[ToolCallItem]:
    """The calls of a constrained (required/named) answer: [] if it was cut off (by
    max_tokens) before any call began."""
    return [p for p in split_call_list(text, final=True) if isinstance(p, ToolCallItem)]


def _finish(reason: str | None, calls: int) -> str | None:
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
        message["tool_calls"] = [
            {
                "id": _call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return message, _finish(finish_reason, len(calls))


class ChatOutputStream:
    """One sample's deltas: ``feed`` each text delta, then ``finish`` with the finish reason.

    Tool calls stream as OpenAI streams them: a call's first delta has its ``index``,
    ``id``, ``type`` and ``function.name`` with the arguments' text so far, later deltas
    ``index`` and the next ``function.arguments`` fragment (they add up to the arguments
    of the whole answer)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.reasoning = (
            ReasoningStream(plan.reasoning, plan.stream_reasoning) if plan.reasoning else None
        )
        self.tools: ToolCallStream | None = None
        if plan.forced_calls:
            self.tools = ToolCallStream(split_call_list)
        elif plan.tool_parser is not None:
            self.tools = ToolCallStream(plan.tool_parser.split)
        self.call_ids: list[str] = []

    def feed(self, text: str) -> dict[str, Any]:
        return self._delta(self._split(text, final=False))

    def finish(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        delta = self._delta(self._split("", final=True))
        return delta, _finish(finish_reason, len(self.call_ids))

    def _split(self, text: str, final: bool) -> StreamDelta:
        out = StreamDelta(content=text)
        if self.reasoning is not None:
            out = self.reasoning.finish() if final else self.reasoning.feed(text)
        if self.tools is not None:
            part = self.tools.feed(out.content)
            if final:
                part = _merge(part, self.tools.finish())
            out.content, out.calls = part.content, part.calls
            if not self.plan.parallel_tool_calls:
                out.calls = [c for c in out.calls if c.index == 0]
        return out

    def _delta(self, part: StreamDelta) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if part.reasoning:
            delta["reasoning_content"] = part.reasoning
        if part.content:
            delta["content"] = part.content
        if part.calls:
            delta["tool_calls"] = [self._call_delta(c) for c in part.calls]
        return delta

    def _call_delta(self, call: ToolCallDelta) -> dict[str, Any]:
        if call.name is None:
            return {"index": call.index, "function": {"arguments": call.arguments}}
        self.call_ids.append(_call_id())
        return {
            "index": call.index,
            "id": self.call_ids[call.index],
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }


def _merge(first: StreamDelta, second: StreamDelta) -> StreamDelta:
    """Two deltas as one; a call's fragments in both become one fragment."""
    calls = list(first.calls)
    for call in second.calls:
        if calls and calls[-1].index == call.index and call.name is None:
            last = calls[-1]
            calls[-1] = ToolCallDelta(last.index, last.name, last.arguments + call.arguments)
        else:
            calls.append(call)
    return StreamDelta(
        content=first.content + second.content,
        reasoning=first.reasoning + second.reasoning,
        calls=calls,
    )
