"""The official openai client against a real kvflow server: chat, streaming, completions, n, seeds,
stop strings, logprobs; and the native API."""

from __future__ import annotations

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_chat_greedy(client, server):
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0
    )
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0
    server.wait_idle_and_free()


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]


def test_cached_tokens_reported(client):
    client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=2)
    again = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=2
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_string_list_and_ids(client):
    one = client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert one.choices[0].text.strip().startswith("Paris")
    many = client.completions.create(
        model="m", prompt=["Hello", "One, two,"], max_tokens=3, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1]
    ids = client.completions.create(
        model="m", prompt=[504, 3575, 282, 4649, 314], max_tokens=2, temperature=0
    )
    assert ids.usage.prompt_tokens == 5


def test_completions_echo_and_logprobs(client):
    echoed = client.completions.create(
        model="m", prompt="Paris is", max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith("Paris is")
    scored = client.completions.create(
        model="m", prompt="Paris is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = scored.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_n_two_and_seeded_sampling(client):
    params = dict(model="m", messages=QUESTION, temperature=1.0, max_tokens=12, seed=7)
    first = client.chat.completions.create(**params)
    second = client.chat.completions.create(**params)
    assert first.choices[0].message.content == second.choices[0].message.content
    pair = client.chat.completions.create(n=2, **params)
    assert [c.index for c in pair.choices] == [0, 1]
    assert pair.choices[0].message.content == first.choices[0].message.content


def test_stop_strings(client):
    reply = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, stop=[" is"]
    )
    assert reply.choices[0].message.content == "The capital of France"
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, stop=[" is"], stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == "The capital of France"
    )


def test_chat_logprobs(client):
    reply = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    assert all(item.top_logprobs[0].token == item.token for item in content)


def test_length_finish_and_extra_params(client):
    reply = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        max_tokens=5,
        temperature=0.7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


def test_native_generate_batch_and_stream(server):
    body = {
        "text": ["The capital of France is", "Hello"],
        "sampling_params": {"temperature": 0, "max_new_tokens": 3},
    }
    out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert len(out) == 2 and out[0]["meta_info"]["completion_tokens"] == 3
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        timeout=60,
        json={"input_ids": [504, 3575], "stream": True, "sampling_params": {"max_new_tokens": 4}},
    ) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2


def test_metrics_exposed(server):
    httpx.post(
        f"{server.url}/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
        timeout=60,
    )
    text = httpx.get(f"{server.url}/metrics").text
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cached_tokens_total",
        "sglang:num_aborted_requests_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_bucket",
        'num_pages="6000",page_size="1"}',
    ]:
        assert name in text, name
    assert "_created" not in text  # as SGLang: no creation-timestamp series


def test_health_generate_and_flush(server):
    assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    server.wait_idle_and_free()
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).json() == {"flushed": True}
    assert server.server_info()["stats"]["cached_tokens"] == 0


def test_server_info_names_the_model_and_kv_dtypes(server):
    """/get_server_info: the weights' dtype and the KV cache's (float32 here, the tests'
    CPU default; --kv-cache-dtype auto keeps the model's)."""
    info = server.server_info()
    assert (info["dtype"], info["kv_cache_dtype"]) == ("float32", "float32")
