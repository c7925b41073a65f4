"""Streaming over the parsers: text deltas in, content / reasoning / calls out.

Each wrapper keeps the whole output so far and a position up to which it has been sent;
text that may be the start of a marker is held until it is decided. The parts a stream
sends add up to what the parser gives for the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.runtime.server.parsers.base import (
    ReasoningParser,
    ToolCallItem,
    ToolCallParser,
    held_suffix,
)

__all__ = ["ReasoningStream", "StreamDelta", "ToolCallStream"]


@dataclass
class StreamDelta:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class ToolCallStream:
    """Sends content until a call begins, then holds the rest and parses it at the end
    (every call arrives whole, in the last delta: OpenAI's format allows one chunk per call)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.in_call = False

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        if self.in_call:
            return StreamDelta()
        start = self.parser.call_start(self.text)
        if start is not None and start >= self.sent:
            self.in_call = True
            return self._send_to(start)
        return self._send_to(max(self.parser.hold_from(self.text), self.sent))

    def finish(self) -> StreamDelta:
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        if not self.in_call:
            return StreamDelta(content=rest)
        parsed = self.parser.parse(rest)
        return StreamDelta(content=parsed.content, calls=parsed.calls)

    def _send_to(self, end: int) -> StreamDelta:
        chunk, self.sent = self.text[self.sent : end], max(end, self.sent)
        return StreamDelta(content=chunk)


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
