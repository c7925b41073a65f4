"""The named formats: SGLang's ``--tool-call-parser`` and ``--reasoning-parser`` names."""

from __future__ import annotations

from kvflow.runtime.server.parsers.base import ReasoningParser, ToolCallParser
from kvflow.runtime.utils.registry import Registry

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "make_reasoning_parser",
    "make_tool_call_parser",
]

_PKG = "kvflow.runtime.server.parsers"

TOOL_CALL_PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")
TOOL_CALL_PARSERS.register("llama3", f"{_PKG}.llama3:Llama3ToolCallParser")
for _name in ("hermes", "qwen", "qwen25"):  # one <tool_call> format under SGLang's names
    TOOL_CALL_PARSERS.register(_name, f"{_PKG}.hermes:HermesToolCallParser")

REASONING_PARSERS: Registry[ReasoningParser] = Registry("reasoning parser")
REASONING_PARSERS.register("deepseek-r1", f"{_PKG}.reasoning:DeepSeekR1ReasoningParser")
REASONING_PARSERS.register("qwen3", f"{_PKG}.reasoning:Qwen3ReasoningParser")


def make_tool_call_parser(name: str) -> ToolCallParser:
    return TOOL_CALL_PARSERS.get(name)()


def make_reasoning_parser(name: str) -> ReasoningParser:
    return REASONING_PARSERS.get(name)()
