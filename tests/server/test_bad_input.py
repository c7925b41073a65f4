"""Bad input gets a clear 4xx, never a 500; afterwards the server still serves and its KV pool
returns to empty."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]

BAD_REQUESTS = [
    (
        "prompt over context",
        CHAT,
        {"messages": [{"role": "user", "content": "word " * 2100}]},
        "context length",
    ),
    (
        "prompt + max_tokens over context",
        CHAT,
        {"messages": MSG, "max_tokens": 2040},
        "exceeds the context",
    ),
    ("negative temperature", CHAT, {"messages": MSG, "temperature": -0.5}, "temperature"),
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    ("top_p above one", CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
    ("temperature as text", CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
    ("stream as text", CHAT, {"messages": MSG, "stream": "yes"}, "stream"),
    ("messages missing", CHAT, {"model": "m"}, "messages"),
    ("empty messages", CHAT, {"messages": []}, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "empty"),
    ("empty id list", "/v1/completions", {"prompt": []}, "empty"),
    ("token id outside vocab", "/v1/completions", {"prompt": [1, 99999999]}, "vocabulary"),
    ("negative token id", "/generate", {"input_ids": [-1, 5]}, "vocabulary"),
    (
        "unknown sampling param",
        "/generate",
        {"text": "x", "sampling_params": {"tempurature": 1}},
        "unknown",
    ),
    ("n zero", CHAT, {"messages": MSG, "n": 0}, "n must"),
    (
        "too many top logprobs",
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": 99},
        "top_logprobs",
    ),
    ("echo with logprobs", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("text and ids", "/generate", {"text": "x", "input_ids": [1]}, "exactly one"),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "message"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request_is_a_clear_4xx(server, case, path, body, message):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert 400 <= response.status_code < 500, response.text
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2, 3]", b'"just a string"', b""])
def test_malformed_or_non_object_json(server, raw):
    for path in (CHAT, "/v1/completions", "/generate", "/abort_request"):
        response = httpx.post(
            f"{server.url}{path}", content=raw, headers={"content-type": "application/json"}
        )
        assert 400 <= response.status_code < 500, (path, raw, response.text)


def test_server_still_serves_and_pool_is_empty_after_bad_input(server):
    for _, path, body, _ in BAD_REQUESTS:
        httpx.post(f"{server.url}{path}", json=body, timeout=60)
    ok = httpx.post(f"{server.url}{CHAT}", json={"messages": MSG, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200
    server.wait_idle_and_free()
