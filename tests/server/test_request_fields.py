"""Strict request fields: unknown ones are a 400 naming them; OpenAI's and SGLang's own are
honoured, ignored on purpose (same answer as without them) or refused unless at their default."""

from __future__ import annotations

import json

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
    (CHAT, "return_hidden_states", True),
    (CHAT, "stop_regex", "\\d"),
    (CHAT, "functions", [{"name": "f"}]),
    ("/v1/completions", "suffix", "!"),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "no_stop_trim", True),
    ("/generate", "return_hidden_states", True),
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


@pytest.mark.parametrize("path", [CHAT, "/generate"])
def test_lora_path_without_enable_lora_is_400(server, path):
    """SGLang's lora_path is honoured with --enable-lora (tests/lora); without it, a 400."""
    response = _post(server, path, {**BASE[path], "lora_path": "adapter-1"})
    assert response.status_code == 400, response.text
    assert "--enable-lora" in response.json()["error"]["message"]
    assert _post(server, path, {**BASE[path], "lora_path": None}).status_code == 200


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


def _chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_stream_options_usage_last_and_on_every_chunk(server, path):
    body = {**BASE[path], "max_tokens": 8, "ignore_eos": True, "stream": True}
    whole = _post(server, path, {**BASE[path], "max_tokens": 8, "ignore_eos": True}).json()
    # include_usage: one more chunk, with no choices, carrying the whole answer's usage
    chunks = _chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all("usage" not in c for c in chunks[:-1])
    # continuous_usage_stats (SGLang's): every chunk carries its sample's usage so far
    chunks = _chunks(server, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == whole["usage"]["prompt_tokens"] for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 8
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # without stream_options: no usage anywhere
    assert all("usage" not in c for c in _chunks(server, path, body))


def test_unknown_stream_option_is_a_400_naming_it(server):
    body = {**BASE[CHAT], "stream": True, "stream_options": {"include_usgae": True}}
    response = _post(server, CHAT, body)
    assert response.status_code == 400, response.text
    assert "stream_options.include_usgae" in response.json()["error"]["message"]


MESSAGE_CASES = [
    # (messages, status, words the error names)
    ([{"role": "user", "content": "Hi", "nmae": "x"}], 400, ["messages[0].'nmae'", "unknown"]),
    (
        [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}],
        400,
        ["messages[0].content[0].'cache_control'", "unknown"],
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        400,
        ["messages[0].content[0]", "'image_url'", "text only"],
    ),
    ([{"role": "user", "content": [{"type": "picture"}]}], 400, ["unknown type 'picture'"]),
    (
        [*MSG, {"role": "assistant", "content": "No.", "refusal": "I cannot."}],
        400,
        ["messages[1].'refusal'", "not supported"],
    ),
    (
        [
            *MSG,
            {
                "role": "assistant",
                "content": "x",
                "tool_calls": [{"id": "c", "x": 1, "function": {"name": "f", "arguments": "{}"}}],
            },
        ],
        400,
        ["tool_calls.0.x"],
    ),
    # every field OpenAI or SGLang defines for a message, at values kvflow honours
    (
        [
            {"role": "system", "content": "Be brief.", "name": "setup"},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Look it up.",
                "refusal": None,
                "audio": None,
                "function_call": None,
                "phase": None,
                "tools": None,
                "prefix": False,
                "tool_calls": [
                    {
                        "id": "c1",
                        "index": 0,
                        "type": "function",
                        "function": {"name": "f", "arguments": {"city": "Nice"}},
                    },
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "f"},
        ],
        200,
        [],
    ),
]


@pytest.mark.parametrize(("messages", "status", "words"), MESSAGE_CASES)
def test_message_fields_are_checked(server, messages, status, words):
    response = _post(server, CHAT, {**BASE[CHAT], "messages": messages})
    assert response.status_code == status, response.text
    for word in words:
        assert word in response.json()["error"]["message"], word


def test_message_name_reaches_the_chat_template(server, tokenizer):
    """The embedded template renders no ``name``: the prompt is the same with one (as with
    SGLang, the template decides); a template that renders it is given it."""
    plain = _post(server, CHAT, BASE[CHAT]).json()
    named = [{**MSG[0], "name": "ann"}]
    with_name = _post(server, CHAT, {**BASE[CHAT], "messages": named}).json()
    assert with_name["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    from kvflow.runtime.server.openai.chat_plan import plan_chat
    from kvflow.runtime.server.openai.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": named})
    rendered, _ = plan_chat(body, None, None).render_messages(body.messages, False)
    assert rendered == [{"role": "user", "content": MSG[0]["content"], "name": "ann"}]


CONTINUED = [*MSG, {"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message_continues_the_assistant_text(server, tokenizer):
    body = {**BASE[CHAT], "messages": CONTINUED, "max_tokens": 8, "continue_final_message": True}
    reply = _post(server, CHAT, body)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    # the prompt is the chat up to the assistant's turn, then its text: nothing after it
    head = tokenizer.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(head + CONTINUED[-1]["content"], add_special_tokens=False)["input_ids"]
    assert reply["usage"]["prompt_tokens"] == len(ids)
    sampling = {"temperature": 0, "max_new_tokens": 8}
    native = _post(server, "/generate", {"input_ids": ids, "sampling_params": sampling}).json()
    content = reply["choices"][0]["message"]["content"]
    assert content == native["text"] and content
    # not a new answer: a new turn would start elsewhere
    answer = _post(server, CHAT, {**body, "continue_final_message": False}).json()
    assert answer["usage"]["prompt_tokens"] > len(ids)
    # vLLM's spelling of the same request
    vllm = _post(server, CHAT, {**body, "add_generation_prompt": False}).json()
    assert vllm["choices"][0]["message"]["content"] == content


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"add_generation_prompt": True}, "cannot both be true"),
        ({"messages": MSG}, "the last message to be the assistant's"),
    ],
)
def test_continue_final_message_refusals(server, extra, message):
    body = {**BASE[CHAT], "messages": CONTINUED, "continue_final_message": True, **extra}
    response = _post(server, CHAT, body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_add_generation_prompt_false_leaves_out_the_assistant_header(server, tokenizer):
    plain = _post(server, CHAT, BASE[CHAT]).json()
    bare = _post(server, CHAT, {**BASE[CHAT], "add_generation_prompt": False}).json()
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert bare["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] - len(header)
    server.wait_idle_and_free()
