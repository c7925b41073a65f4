"""Tool calls and reasoning through the chat endpoint of a real server (hermes tool-call
parser, qwen3 reasoning parser): constrained required/named calls from the embedded model,
parsed calls and reasoning (whole and streamed), and tool results round-tripping."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from server_process import ServerProcess

from kvflow.runtime.server.openai.chat_plan import plan_chat
from kvflow.runtime.server.openai.protocol import ChatCompletionRequest
from kvflow.runtime.wire import RequestError

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", '
    r'"unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tool_server(embedded_ready, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-total-tokens",
        "6000",
        "--context-length",
        "2048",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        log=tmp_path_factory.mktemp("tools") / "server.log",
    )
    yield proc
    proc.stop()


def _chat(server: ServerProcess, **body) -> dict:
    body = {"messages": ASK, "temperature": 0, "max_tokens": 60, **body}
    response = httpx.post(f"{server.url}{CHAT}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _stream(server: ServerProcess, **body) -> tuple[dict, str | None]:
    """The deltas of one streamed answer merged into a message, and its finish reason."""
    body = {"messages": ASK, "temperature": 0, "max_tokens": 60, "stream": True, **body}
    merged: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            merged["content"] += delta.get("content") or ""
            merged["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                if call["index"] == len(merged["tool_calls"]):  # a call's first delta
                    assert call["id"]
                    merged["tool_calls"].append(call)
                else:  # a fragment of its arguments
                    fragment = call["function"]["arguments"]
                    merged["tool_calls"][call["index"]]["function"]["arguments"] += fragment
            finish = choice["finish_reason"] or finish
    return merged, finish


def _check_call(call: dict, tool: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == tool["function"]["name"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_required_tool_choice_gives_a_valid_call(tool_server):
    choice = _chat(tool_server, tools=[WEATHER, TIME], tool_choice="required")
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] is None and message["tool_calls"]
    for call in message["tool_calls"]:
        _check_call(call, WEATHER if call["function"]["name"] == "get_weather" else TIME)


@pytest.mark.parametrize("tool", [WEATHER, TIME], ids=["get_weather", "get_time"])
def test_named_tool_choice_calls_that_function(tool_server, tool):
    named = {"type": "function", "function": {"name": tool["function"]["name"]}}
    choice = _chat(tool_server, tools=[WEATHER, TIME], tool_choice=named)
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1
    _check_call(calls[0], tool)


def test_streamed_required_call_matches_the_whole_answer(tool_server):
    whole = _chat(tool_server, tools=[WEATHER], tool_choice="required")
    merged, finish = _stream(tool_server, tools=[WEATHER], tool_choice="required")
    assert finish == "tool_calls" and merged["content"] == ""
    assert [c["function"] for c in merged["tool_calls"]] == [
        c["function"] for c in whole["message"]["tool_calls"]
    ]


def test_auto_parses_hermes_calls_whole_and_streamed(tool_server):
    # the regex stands in for a model that chose to call: the parser reads its text
    choice = _chat(tool_server, tools=[WEATHER], regex=FORCED_CALL)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert _check_call(call, WEATHER)["unit"] == "celsius"
    merged, finish = _stream(tool_server, tools=[WEATHER], regex=FORCED_CALL)
    assert finish == "tool_calls"
    assert [c["function"] for c in merged["tool_calls"]] == [call["function"]]
    # tool_choice none: the same text stays content
    plain = _chat(tool_server, tools=[WEATHER], tool_choice="none", regex=FORCED_CALL)
    assert plain["finish_reason"] == "stop" and "<tool_call>" in plain["message"]["content"]
    assert "tool_calls" not in plain["message"]


def test_reasoning_content_whole_streamed_and_not_separated(tool_server):
    regex = r"<think>\n[a-z]+( [a-z]+){2}\.\n</think>\n\n[A-Z][a-z]+( [a-z]+){2}\."
    choice = _chat(tool_server, regex=regex)
    message = choice["message"]
    assert message["reasoning_content"] and "<think>" not in message["reasoning_content"]
    assert message["content"] and "</think>" not in message["content"]
    merged, finish = _stream(tool_server, regex=regex)
    assert finish == choice["finish_reason"]
    assert merged["reasoning_content"] == message["reasoning_content"]
    assert merged["content"] == message["content"]
    batched, _ = _stream(tool_server, regex=regex, stream_reasoning=False)
    assert batched["reasoning_content"] == message["reasoning_content"]
    joined = _chat(tool_server, regex=regex, separate_reasoning=False)["message"]
    assert "reasoning_content" not in joined
    assert joined["content"].startswith("<think>") and message["content"] in joined["content"]


def test_tool_results_round_trip(tool_server):
    first = _chat(tool_server, tools=[WEATHER], tool_choice="required")["message"]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "22 C, sunny"},
    ]
    body = {"messages": history, "tools": [WEATHER], "temperature": 0, "max_tokens": 30}
    response = httpx.post(f"{tool_server.url}{CHAT}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply = response.json()
    shorter = {**body, "messages": ASK}
    alone = httpx.post(f"{tool_server.url}{CHAT}", json=shorter, timeout=120).json()
    # the call and the result are in the prompt
    assert reply["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"] + 20
    tool_server.wait_idle_and_free()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not among the tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "regex": "a+"},
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_requests_are_400(tool_server, body, message):
    response = httpx.post(f"{tool_server.url}{CHAT}", json={"messages": ASK, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_auto_without_a_tool_call_parser_is_refused():
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    with pytest.raises(RequestError, match="--tool-call-parser"):
        plan_chat(body, None, None)
    assert plan_chat(body.model_copy(update={"tool_choice": "required"}), None, None).forced_calls


def test_fallback_prompt_renders_tools_calls_and_results():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [WEATHER],
        }
    )
    plan = plan_chat(body, "hermes", None)
    messages, extra = plan.render_messages(body.messages, template_has_tools=False)
    assert extra == {}
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    # a template that renders tools itself gets them as data
    messages, extra = plan.render_messages(body.messages, template_has_tools=True)
    assert extra == {"tools": [WEATHER]} and messages[0]["role"] == "user"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Nice"}
