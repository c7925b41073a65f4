"""``<think>...</think>`` reasoning formats under SGLang's ``--reasoning-parser`` names."""

from __future__ import annotations

from kvflow.runtime.server.parsers.base import ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser"]


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template opens ``<think>``, so the output is reasoning until
    ``</think>`` whether or not the model repeats the start marker."""

    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the output opens with ``<think>`` (thinking can be off)."""

    starts_in_reasoning = False
