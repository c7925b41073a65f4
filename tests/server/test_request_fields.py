"""Strict request fields: unknown ones are a 400 naming them; OpenAI's and SGLang's own are
honoured, ignored on purpose (same answer as without them) or refused unless at their default."""

from __future__ import annotations

import httpx
import pytest

from kvflow.runtime.server.openai.fields import ENDPOINT_FIELDS, IGNORED, REFUSED_UNLESS_DEFAULT

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the capital of France?"}]
BASE = {
    CHAT: {"messages": MSG, "temperature": 0, "max_tokens": 6},
    "/v1/completions": {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 6},
    "/generate": {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0, "max_new_tokens": 6},
    },
}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _text(path: str, reply: dict) -> str:
    if path == "/generate":
        return reply["text"]
    choice = reply["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


def test_every_known_field_has_a_rule():
    for endpoint, names in ENDPOINT_FIELDS.items():
        for name in names:
            assert name in IGNORED or name in REFUSED_UNLESS_DEFAULT, (endpoint, name)


@pytest.mark.parametrize("path", list(BASE))
def test_unknown_field_is_a_400_naming_it(server, path):
    response = _post(server, path, {**BASE[path], "temprature": 0.5})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "'temprature'" in error["message"] and "unknown field" in error["message"]
    assert error["code"] == 400


def test_unknown_sampling_param_is_a_400_naming_it(server):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1, "top_kk": 3}}
    response = _post(server, "/generate", body)
    assert response.status_code == 400
    assert "sampling_params.'top_kk'" in response.json()["error"]["message"]


IGNORED_CASES = {
    CHAT: {
        "user": "u-1",
        "metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
        "priority": 3,
        "custom_labels": {"team": "x"},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "data_parallel_rank": 0,
    },
    "/v1/completions": {"user": "u-1", "priority": 1, "routed_dp_rank": 0},
    # what sglang-router and bench_serving --backend sglang add
    "/generate": {
        "model": "anything",
        "log_metrics": False,
        "no_logs": True,
        "return_hidden_states": False,
        "return_entropy": False,
        "return_bytes": False,
        "background": False,
        "lora_path": None,
        "return_routed_experts": False,
        "logprob_start_len": -1,
        "routing_key": "r",
        "custom_labels": {"a": "b"},
    },
}


@pytest.mark.parametrize("path", list(BASE))
def test_ignored_fields_leave_the_answer_unchanged(server, path):
    plain = _post(server, path, BASE[path])
    with_extras = _post(server, path, {**BASE[path], **IGNORED_CASES[path]})
    assert plain.status_code == with_extras.status_code == 200, with_extras.text
    assert _text(path, with_extras.json()) == _text(path, plain.json())


REFUSED_CASES = [
    (CHAT, "lora_path", "adapter-1"),
    (CHAT, "return_hidden_states", True),
    (CHAT, "stop_regex", "\\d"),
    (CHAT, "continue_final_message", True),
    (CHAT, "functions", [{"name": "f"}]),
    ("/v1/completions", "suffix", "!"),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "no_stop_trim", True),
    ("/generate", "return_hidden_states", True),
    ("/generate", "lora_path", "adapter-1"),
    ("/generate", "image_data", "http://x/y.png"),
    ("/generate", "session_params", {"id": "s"}),
]


@pytest.mark.parametrize(("path", "name", "value"), REFUSED_CASES)
def test_fields_that_would_change_the_answer_are_refused_when_set(server, path, name, value):
    response = _post(server, path, {**BASE[path], name: value})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"'{name}'" in message and "not supported by kvflow" in message
    default = REFUSED_UNLESS_DEFAULT[name][0][0]
    assert _post(server, path, {**BASE[path], name: default}).status_code == 200


def test_sglang_sampling_params_are_honoured_or_ignored(server):
    base = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 6}}

    def sample(**params) -> str:
        body = {**base, "sampling_params": {**base["sampling_params"], **params}}
        response = _post(server, "/generate", body)
        assert response.status_code == 200, response.text
        return response.json()["text"]

    # sampling_seed is SGLang's name of the seed: the same draw as seed
    assert sample(temperature=1.0, sampling_seed=7) == sample(temperature=1.0, seed=7)
    assert sample(temperature=1.0, sampling_seed=7) != sample(temperature=1.0, sampling_seed=8)
    # RuntimeEndpoint always sends these two
    assert sample(temperature=0, spaces_between_special_tokens=True, stream_interval=4) == sample(
        temperature=0
    )
    refused = _post(server, "/generate", {**base, "sampling_params": {"no_stop_trim": True}})
    assert refused.status_code == 400
    assert "sampling_params.'no_stop_trim'" in refused.json()["error"]["message"]


def test_return_text_in_logprobs(server):
    body = {**BASE["/generate"], "return_logprob": True, "top_logprobs_num": 2}
    plain = _post(server, "/generate", body).json()["meta_info"]
    assert all(entry[2] is None for entry in plain["output_token_logprobs"])
    meta = _post(server, "/generate", {**body, "return_text_in_logprobs": True}).json()
    texts = [entry[2] for entry in meta["meta_info"]["output_token_logprobs"]]
    assert "".join(texts) == meta["text"]
    assert [e[:2] for e in meta["meta_info"]["output_token_logprobs"]] == [
        e[:2] for e in plain["output_token_logprobs"]
    ]
    assert all(
        isinstance(e[2], str) for top in meta["meta_info"]["output_top_logprobs"] for e in top
    )


def test_cache_salt_keeps_prefixes_apart(server):
    prompt = "Tell me about the history of the city of Lyon in France. " * 4

    def cached(**extra) -> int:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        response = _post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="alice")
    assert cached(cache_salt="alice") > 0
    assert cached(cache_salt="bob") == 0
    cached(extra_key="k", cache_salt="alice")
    assert cached(extra_key="k", cache_salt="alice") > 0
    server.wait_idle_and_free()
