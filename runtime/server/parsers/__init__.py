"""Parsers of model output: tool calls (``--tool-call-parser``) and reasoning
(``--reasoning-parser``), each a registry of named formats; plus the streaming wrappers that
hold text back while a call or a reasoning marker may be starting."""

from kvflow.runtime.server.parsers.base import (
    OutputPart,
    ParsedToolCalls,
    ReasoningParser,
    ToolCallItem,
    ToolCallParser,
)
from kvflow.runtime.server.parsers.json_call import split_call_list
from kvflow.runtime.server.parsers.registry import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    make_reasoning_parser,
    make_tool_call_parser,
)
from kvflow.runtime.server.parsers.stream import (
    ReasoningStream,
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "OutputPart",
    "ParsedToolCalls",
    "ReasoningParser",
    "ReasoningStream",
    "StreamDelta",
    "ToolCallDelta",
    "ToolCallItem",
    "ToolCallParser",
    "ToolCallStream",
    "make_reasoning_parser",
    "make_tool_call_parser",
    "split_call_list",
]
