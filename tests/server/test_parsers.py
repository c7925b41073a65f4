"""Tool-call and reasoning parsers: whole outputs, and streams cut at every size give the same
parts as the whole output."""

from __future__ import annotations

import pytest

from kvflow.runtime.server.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ReasoningStream,
    ToolCallItem,
    ToolCallStream,
    make_reasoning_parser,
    make_tool_call_parser,
)

HERMES = [
    ("Hello there.", "Hello there.", []),
    (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
        "Let me check.",
        [ToolCallItem("f", '{"a": 1}')],
    ),
    (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>',
        "",
        [ToolCallItem("f", "{}"), ToolCallItem("g", '{"x": [1, 2]}')],
    ),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("a <tool_ca", "a <tool_ca", []),
]
LLAMA3 = [
    ("Paris is the capital.", "Paris is the capital.", []),
    ('{"name": "f", "parameters": {"a": "b"}}', "", [ToolCallItem("f", '{"a": "b"}')]),
    (
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"n": 2}}',
        "",
        [ToolCallItem("f", "{}"), ToolCallItem("g", '{"n": 2}')],
    ),
    ('I think {"name": "f", "parameters": {}}', 'I think {"name": "f", "parameters": {}}', []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
]


def _streamed(parser, text: str, size: int):
    stream = ToolCallStream(parser)
    parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
    parts.append(stream.finish())
    return "".join(p.content for p in parts), [c for p in parts for c in p.calls]


@pytest.mark.parametrize(
    ("name", "cases"), [("hermes", HERMES), ("qwen", HERMES), ("llama3", LLAMA3)]
)
def test_tool_call_parsers_whole_and_streamed(name, cases):
    parser = make_tool_call_parser(name)
    for text, content, calls in cases:
        parsed = parser.parse(text)
        assert (parsed.content, parsed.calls) == (content, calls), text
        for size in (1, 2, 3, 7, len(text)):
            streamed_content, streamed_calls = _streamed(parser, text, size)
            assert streamed_calls == calls, (text, size)
            if calls:  # the text around calls is stripped in both
                assert streamed_content.strip() == content, (text, size)
            else:
                assert streamed_content == text, (text, size)


def test_render_then_parse_round_trips():
    calls = [ToolCallItem("f", '{"a": 1}'), ToolCallItem("g", "{}")]
    for name in TOOL_CALL_PARSERS.choices():
        parser = make_tool_call_parser(name)
        assert parser.parse(parser.render_calls(calls)).calls == calls, name


REASONING = [
    # (parser, text, reasoning, content)
    ("qwen3", "<think>\nStep one.\n</think>\n\nParis.", "Step one.\n", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "<think>cut off", "cut off", ""),
    ("qwen3", "<thinking> is a word", None, "<thinking> is a word"),
    ("deepseek-r1", "Step one.</think>Paris.", "Step one.", "Paris."),
    ("deepseek-r1", "<think>Step one.</think>\nParis.", "Step one.", "Paris."),
    ("deepseek-r1", "no end marker", "no end marker", ""),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING)
def test_reasoning_parsers_whole_and_streamed(name, text, reasoning, content):
    assert name in REASONING_PARSERS.choices()
    parser = make_reasoning_parser(name)
    assert parser.parse(text) == (reasoning, content)
    for size in (1, 2, 5, len(text)):
        for stream_reasoning in (True, False):
            stream = ReasoningStream(parser, stream_reasoning)
            parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
            parts.append(stream.finish())
            assert "".join(p.reasoning for p in parts) == (reasoning or ""), (size, text)
            assert "".join(p.content for p in parts) == content, (size, text)
            if not stream_reasoning:
                assert sum(1 for p in parts if p.reasoning) <= 1
