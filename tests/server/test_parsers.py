"""Tool-call and reasoning parsers: whole outputs, and streams cut at every size give the same
parts as the whole output."""

from __future__ import annotations

import itertools

import pytest

from kvflow.runtime.server.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ReasoningStream,
    ToolCallItem,
    ToolCallStream,
    make_reasoning_parser,
    make_tool_call_parser,
    split_call_list,
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


def _streamed(split, text: str, size: int):
    """Content and calls of ``text`` fed ``size`` characters at a time; also checks that the
    deltas are OpenAI's: a call's first delta has its name, later ones only fragments."""
    stream = ToolCallStream(split)
    parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
    parts.append(stream.finish())
    names: list[str] = []
    arguments: list[str] = []
    for delta in (c for p in parts for c in p.calls):
        if delta.name is not None:
            assert delta.index == len(names)
            names.append(delta.name)
            arguments.append(delta.arguments)
        else:
            assert delta.index < len(names)
            arguments[delta.index] += delta.arguments
    calls = [ToolCallItem(n, a) for n, a in zip(names, arguments, strict=True)]
    return "".join(p.content for p in parts), calls


def _extends(before, after) -> bool:
    """``after`` (the split of a longer text) only adds to ``before``."""
    if len(after) < len(before):
        return False
    for old, new in zip(before, after, strict=False):
        if isinstance(old, str) != isinstance(new, str):
            return False
        if isinstance(old, str) and not new.startswith(old):
            return False
        if isinstance(old, ToolCallItem) and (
            old.name != new.name or not new.arguments.startswith(old.arguments)
        ):
            return False
    return True


def _check_only_extends(split, text: str) -> None:
    """What a split of each prefix gives only grows: a stream never has to take back what
    it sent."""
    splits = [split(text[:i], False) for i in range(len(text) + 1)]
    splits.append(split(text, True))
    for before, after in itertools.pairwise(splits):
        assert _extends(before, after), (text, before, after)


@pytest.mark.parametrize(
    ("name", "cases"), [("hermes", HERMES), ("qwen", HERMES), ("llama3", LLAMA3)]
)
def test_tool_call_parsers_whole_and_streamed(name, cases):
    parser = make_tool_call_parser(name)
    for text, content, calls in cases:
        parsed = parser.parse(text)
        assert (parsed.content, parsed.calls) == (content, calls), text
        for size in (1, 2, 3, 7, len(text)):
            streamed_content, streamed_calls = _streamed(parser.split, text, size)
            assert streamed_calls == calls, (text, size)
            if calls:  # the text around calls is stripped in both
                assert streamed_content.strip() == content, (text, size)
            else:
                assert streamed_content == text, (text, size)
        _check_only_extends(parser.split, text)


STREAMED = [
    # (parser, text, calls): arguments as written, streamed in fragments
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": [1, 2], "note": "a \\"quoted\\" } brace"}}\n</tool_call>\n'
        '<tool_call>{"arguments": {"tz":"UTC"}, "name": "get_time"}</tool_call>',
        [
            ToolCallItem(
                "get_weather", '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" } brace"}'
            ),
            ToolCallItem("get_time", '{"tz":"UTC"}'),
        ],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice",\n "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {}}',
        [
            ToolCallItem("get_weather", '{"city": "Nice",\n "unit": "celsius"}'),
            ToolCallItem("get_time", "{}"),
        ],
    ),
]


@pytest.mark.parametrize(("name", "text", "calls"), STREAMED)
def test_arguments_stream_in_fragments(name, text, calls):
    parser = make_tool_call_parser(name)
    assert parser.parse(text).calls == calls
    _check_only_extends(parser.split, text)
    for size in (1, 4, 9):
        assert _streamed(parser.split, text, size)[1] == calls
    stream = ToolCallStream(parser.split)
    deltas = [c for i in range(len(text)) for c in stream.feed(text[i]).calls]
    deltas += stream.finish().calls
    first = [d for d in deltas if d.name is not None]
    assert [d.name for d in first] == [c.name for c in calls]
    # the first call's arguments came in many pieces, as the text arrived
    assert sum(1 for d in deltas if d.index == 0) > 10


def test_cut_off_call_stays_a_call_in_both():
    """A call cut off (max_tokens) once its arguments began: the whole answer and the
    stream both give it, with the arguments written so far."""
    parser = make_tool_call_parser("hermes")
    text = '<tool_call>{"name": "f", "arguments": {"city": "Pa'
    assert parser.parse(text).calls == [ToolCallItem("f", '{"city": "Pa')]
    assert _streamed(parser.split, text, 3)[1] == [ToolCallItem("f", '{"city": "Pa')]
    # before its arguments began it is not yet a call: the text stays content
    assert parser.parse('<tool_call>{"name": "f"').calls == []


def test_constrained_call_list_whole_and_streamed():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": [2]}}]'
    calls = [ToolCallItem("f", '{"a": 1}'), ToolCallItem("g", '{"b": [2]}')]
    assert split_call_list(text, final=True) == calls
    _check_only_extends(split_call_list, text)
    for size in (1, 5, len(text)):
        assert _streamed(split_call_list, text, size) == ("", calls)
    # cut off before a call began: the text is all there is
    assert split_call_list('[{"na', final=True) == ['[{"na']


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
