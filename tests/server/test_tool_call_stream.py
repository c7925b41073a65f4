"""Streamed tool calls in OpenAI's delta format through a real server, for the hermes and
llama3 parsers and tool_choice auto, required and a named function (greedy): each call's
first delta has its index, id, type and name; its arguments follow in fragments as tokens
arrive, adding up to the arguments of the same request answered whole."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from server_process import ServerProcess

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
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
# what a model that chose to call writes, in each parser's format (auto reads it back)
AUTO_CALL = {
    "hermes": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", '
    r'"unit": "celsius"\}\}\n</tool_call>',
    "llama3": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Lyon)", '
    r'"unit": "celsius"\}\}',
}
CHOICES = {
    "auto": {},
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}


@pytest.fixture(scope="module", params=["hermes", "llama3"])
def parser_server(request, embedded_ready, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-total-tokens",
        "6000",
        "--context-length",
        "2048",
        "--tool-call-parser",
        request.param,
        log=tmp_path_factory.mktemp(f"tools-{request.param}") / "server.log",
    )
    proc.parser = request.param
    yield proc
    proc.stop()


def _body(server: ServerProcess, choice: str) -> dict:
    body = {"messages": ASK, "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 80}
    if choice == "auto":
        body["regex"] = AUTO_CALL[server.parser]
    return {**body, **CHOICES[choice]}


def _streamed_calls(server: ServerProcess, body: dict) -> tuple[list[dict], str | None, str]:
    """The calls rebuilt from the deltas (with the fragment count of each), the finish
    reason and the content; every delta is checked against OpenAI's format."""
    calls: list[dict] = []
    finish, content = None, ""
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice["finish_reason"] or finish
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                if delta["index"] == len(calls):  # a new call: all its fields
                    assert delta["type"] == "function" and delta["id"].startswith("call_")
                    assert isinstance(delta["function"]["name"], str)
                    calls.append({**delta["function"], "fragments": 1})
                else:  # the next fragment of a call's arguments, nothing else
                    assert delta.keys() == {"index", "function"}, delta
                    assert delta["function"].keys() == {"arguments"}, delta
                    call = calls[delta["index"]]
                    call["arguments"] += delta["function"]["arguments"]
                    call["fragments"] += 1
    return calls, finish, content


@pytest.mark.parametrize("choice", list(CHOICES))
def test_streamed_arguments_add_up_to_the_whole_answers(parser_server, choice):
    body = _body(parser_server, choice)
    response = httpx.post(f"{parser_server.url}{CHAT}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    whole = response.json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    expected = [c["function"] for c in whole["message"]["tool_calls"]]
    calls, finish, content = _streamed_calls(parser_server, body)
    assert finish == "tool_calls"
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
    assert content.strip() == (whole["message"]["content"] or "")
    for call in calls:
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        jsonschema.validate(json.loads(call["arguments"]), schema[call["name"]])
        assert call["fragments"] > 3, call  # streamed as the tokens came, not in one piece
    parser_server.wait_idle_and_free()
