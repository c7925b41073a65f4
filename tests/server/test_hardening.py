"""Single requests that used to take the server down, OpenAI-shaped errors everywhere,
``/v1/models/{id}``, and metrics whose values move as SGLang's do under a known workload."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


def _assert_openai_error(response: httpx.Response, status: int, needle: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == status
    assert needle.lower() in error["message"].lower(), error["message"]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        (CHAT, {"messages": MSG, "seed": 2**70, "max_tokens": 2}, 400, "seed"),
        ("/generate", {"text": "x", "sampling_params": {"seed": 2**70}}, 400, "seed"),
        ("/v1/completions", {"prompt": [-1, 5]}, 400, "vocabulary"),
        ("/v1/completions", {"prompt": [2**70]}, 400, "vocabulary"),
        ("/v1/completions", {"prompt": [[3, 4], [2**64]], "echo": True}, 400, "vocabulary"),
        (CHAT, {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "temperature": "0.5"}, 400, "temperature"),
        (CHAT, {"messages": MSG, "n": 2.0}, 400, "n"),
        (CHAT, {"messages": MSG, "top_k": 2**70}, 400, "top_k"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "5"}}, 400, "type"),
    ],
)
def test_out_of_range_and_stringly_numbers_are_400(server, path, body, status, needle):
    _assert_openai_error(httpx.post(server.url + path, json=body, timeout=60), status, needle)
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(server, literal):
    raw = '{"messages": [{"role": "user", "content": "Hi"}], "temperature": ' + literal + "}"
    response = httpx.post(
        server.url + CHAT, content=raw, headers={"content-type": "application/json"}
    )
    _assert_openai_error(response, 400, "temperature")
    raw = '{"text": "x", "sampling_params": {"top_p": ' + literal + "}}"
    response = httpx.post(
        server.url + "/generate", content=raw, headers={"content-type": "application/json"}
    )
    _assert_openai_error(response, 400, "finite")


@pytest.mark.parametrize(
    "body",
    [
        {"messages": MSG, "temperature": 1e-300, "max_tokens": 3},
        {"messages": MSG, "seed": 2**64 - 1, "n": 2, "temperature": 0.8, "max_tokens": 3},
        {"messages": MSG, "seed": -(2**63), "temperature": 0.8, "max_tokens": 3},
    ],
)
def test_extreme_valid_values_are_served(server, body):
    response = httpx.post(server.url + CHAT, json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == body.get("n", 1)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tiny_temperature_answers_as_greedy(server):
    def ask(temperature: float) -> str:
        body = {"messages": MSG, "temperature": temperature, "max_tokens": 12}
        response = httpx.post(server.url + CHAT, json=body, timeout=120)
        return response.json()["choices"][0]["message"]["content"]

    assert ask(1e-300) == ask(0)


def test_routes_and_bodies_outside_the_api_get_openai_errors(server):
    _assert_openai_error(httpx.get(f"{server.url}/v1/nope"), 404)
    _assert_openai_error(httpx.get(server.url + CHAT), 405)
    undecodable = httpx.post(
        server.url + CHAT, content=b"\xff\xfe{", headers={"content-type": "application/json"}
    )
    _assert_openai_error(undecodable, 400)
    _assert_openai_error(
        httpx.post(
            server.url + CHAT,
            content=b'{"messages": [',
            headers={"content-type": "application/json"},
        ),
        400,
    )


def test_models_retrieve(server):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    name = client.models.list().data[0].id
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model"
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")


def _samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert "model_name" in sample.labels, sample
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def test_metrics_move_as_sglang_defines_them(server):
    server.wait_idle_and_free()
    before = _samples(server)
    for key in [
        ("kvflow:num_rejected_requests_total", (("reason", "queue_full"),)),
        ("sglang:num_aborted_requests_total", ()),
        ("sglang:time_to_first_token_seconds_count", (("is_streaming", "true"),)),
    ]:
        assert key in before, key  # present from the start, zero or not
    prompt_ids = list(range(1000, 1040))
    params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}
    for stream in (False, False, True):
        response = httpx.post(
            f"{server.url}/generate",
            json={"input_ids": prompt_ids, "sampling_params": params, "stream": stream},
            timeout=120,
        )
        assert response.status_code == 200
    busy = _samples(server)  # within the throughput window of the work just done
    assert busy[("sglang:gen_throughput", ())] > 0
    server.wait_idle_and_free()
    time.sleep(0.6)  # the next stats publication
    after = _samples(server)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("sglang:num_requests_total") == 3
    assert delta("sglang:prompt_tokens_total") == 3 * 40
    assert delta("sglang:generation_tokens_total") == 3 * 16
    assert delta("sglang:cached_tokens_total") >= 2 * 39  # the 2nd and 3rd reuse the prompt
    assert delta("sglang:time_to_first_token_seconds_count", (("is_streaming", "false"),)) == 2
    assert delta("sglang:time_to_first_token_seconds_count", (("is_streaming", "true"),)) == 1
    assert delta("sglang:e2e_request_latency_seconds_count") == 3
    assert delta("sglang:inter_token_latency_seconds_count") >= 15
    # idle: nothing is held by requests, though the prefix cache keeps the prompt
    assert after[("sglang:token_usage", ())] == 0
    assert after[("kvflow:prefix_cache_usage", ())] > 0
    assert after[("sglang:num_running_reqs", ())] == 0
