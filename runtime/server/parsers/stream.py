"""Streaming over the parsers: text deltas in, content / reasoning / calls out.

Each wrapper keeps the whole output so far and what it has sent; text that may be the
start of a marker is held until it is decided. The parts a stream sends add up to what the
parser gives for the whole output (a call's argument fragments to its arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.runtime.server.parsers.base import (
    OutputPart,
    ReasoningParser,
    ToolCallItem,
    held_suffix,
)

__all__ = ["ReasoningStream", "StreamDelta", "ToolCallDelta", "ToolCallStream"]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index`` (0, 1, ... in the answer): its first piece has the
    ``name``; every piece has the next fragment of its arguments' text."""

    index: int
    name: str | None
    arguments: str


@dataclass
class StreamDelta:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


Split = Callable[[str, bool], list[OutputPart]]


class ToolCallStream:
    """Sends what ``split`` (a :meth:`ToolCallParser.split`) reads from the output so far,
    less what was sent: new content, each new call with its name and arguments so far,
    then each call's further argument fragments. The fragments of a call add up to its
    arguments in the split of the whole output."""

    def __init__(self, split: Split) -> None:
        self.split = split
        self.text = ""
        self.sent: list[OutputPart] = []

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        return self._send(self.split(self.text, False))

    def finish(self) -> StreamDelta:
        return self._send(self.split(self.text, True))

    def _send(self, parts: list[OutputPart]) -> StreamDelta:
        out = StreamDelta()
        calls = 0
        for i, part in enumerate(parts):
            before = self.sent[i] if i < len(self.sent) else None
            if isinstance(part, str):
                out.content += part[len(before) :] if isinstance(before, str) else part
                continue
            if isinstance(before, ToolCallItem):
                if len(part.arguments) > len(before.arguments):
                    fragment = part.arguments[len(before.arguments) :]
                    out.calls.append(ToolCallDelta(calls, None, fragment))
            else:
                out.calls.append(ToolCallDelta(calls, part.name, part.arguments))
            calls += 1
        self.sent = parts
        return out


class ReasoningStream:
    """Splits streamed text as :meth:`ReasoningParser.parse` splits the whole output.

    ``stream_reasoning=False`` (SGLang's field) sends the reasoning in one piece when it ends.
    """

    def __init__(self, parser: ReasoningParser, stream_reasoning: bool = True) -> None:
        self.parser = parser
        self.stream_reasoning = stream_reasoning
        self.text = ""
        self.pos = 0
        self.phase = "undecided"  # -> "reasoning" -> "content"
        self.pending_reasoning = ""
        self.lstrip = True  # drop leading whitespace of the part being sent

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        out = StreamDelta()
        if self.phase == "undecided":
            self._decide(final=False)
        if self.phase == "reasoning":
            end = self.text.find(self.parser.end, self.pos)
            if end < 0:
                hold = max(held_suffix(self.text, self.parser.end), self.pos)
                out.reasoning = self._reasoning(self._take(hold), final=False)
                return out
            out.reasoning = self._reasoning(self._take(end), final=True)
            self.pos = end + len(self.parser.end)
            self.phase, self.lstrip = "content", True
        if self.phase == "content":
            out.content = self._take(len(self.text))
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.phase == "undecided":
            self._decide(final=True)
        if self.phase == "reasoning":
            out.reasoning = self._reasoning(self._take(len(self.text)), final=True)
        elif self.phase == "content":
            out.content = self._take(len(self.text))
        return out

    def _decide(self, final: bool) -> None:
        body = self.text.lstrip()
        start = self.parser.start
        if body.startswith(start):
            self.phase = "reasoning"
            self.pos = len(self.text) - len(body) + len(start)
        elif start.startswith(body) and not final:
            return  # "", or a part of the start marker: wait
        else:
            self.phase = "reasoning" if self.parser.starts_in_reasoning else "content"
            self.lstrip = self.parser.starts_in_reasoning

    def _take(self, end: int) -> str:
        chunk = self.text[self.pos : end]
        self.pos = max(end, self.pos)
        if self.lstrip:
            chunk = chunk.lstrip()
            self.lstrip = not chunk
        return chunk

    def _reasoning(self, chunk: str, final: bool) -> str:
        if self.stream_reasoning:
            return chunk
        self.pending_reasoning += chunk
        if not final:
            return ""
        whole, self.pending_reasoning = self.pending_reasoning, ""
        return whole
