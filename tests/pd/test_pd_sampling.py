"""Sampling features through router -> prefill -> decode behave as in unified serving: seeded
sampling (the first token drawn on the prefill, the rest on the decode), ``n > 1`` (one
bootstrap room per sample), structured output (the grammar on both sides) and prompt
logprobs (computed by the prefill, returned by the decode)."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "Write a short list of three fruits:"


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def _both(pd, path: str, body: dict) -> tuple[dict, dict]:
    return _post(pd.unified.url, path, body), _post(pd.router.url, path, body)


def _idle(pd) -> None:
    pd.decode.wait_idle_and_free(timeout=30)
    pd.prefill.wait_idle_and_free(timeout=30)


def test_seeded_sampling_with_n_2_equals_unified(pd):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 1234, "n": 2}
    want, got = _both(pd, "/v1/completions", body)
    texts = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
    assert texts == [c["text"] for c in sorted(want["choices"], key=lambda c: c["index"])]
    assert texts[0] != texts[1]  # two samples (seed, seed + 1), not one twice
    for key in ("prompt_tokens", "completion_tokens"):  # cached_tokens: unified warms up
        assert got["usage"][key] == want["usage"][key]
    _idle(pd)


def test_streamed_n_2_through_pd(pd):
    body = {
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.7,
        "seed": 7,
        "n": 2,
        "stream": True,
    }
    texts = {0: "", 1: ""}
    with httpx.stream("POST", f"{pd.router.url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    want = _post(pd.unified.url, "/v1/completions", {**body, "stream": False})
    assert [texts[0], texts[1]] == [c["text"] for c in want["choices"]]
    _idle(pd)


def test_json_schema_output_through_pd_equals_unified(pd):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "temperature": 0,
        "max_tokens": 48,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    }
    want, got = _both(pd, "/v1/chat/completions", body)
    text = got["choices"][0]["message"]["content"]
    assert text == want["choices"][0]["message"]["content"]
    assert set(json.loads(text)) == {"name", "age"}
    _idle(pd)


def test_regex_through_pd_equals_unified(pd):
    body = {
        "text": "The year the first moon landing happened was",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": " (19|20)[0-9]{2}\\."},
    }
    want, got = _both(pd, "/generate", body)
    assert got["text"] == want["text"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    _idle(pd)


def test_bad_grammar_is_refused_by_pd_workers(pd):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 4, "regex": "(unclosed"}}
    response = httpx.post(f"{pd.router.url}/generate", json=body, timeout=60)
    assert response.status_code == 400, response.text
    _idle(pd)


def test_prompt_logprobs_through_pd_equal_unified(pd):
    body = {
        "input_ids": list(range(3000, 3090)),  # longer than the 64-token chunk
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    want, got = _both(pd, "/generate", body)
    assert got["output_ids"] == want["output_ids"]
    got_in, want_in = (
        got["meta_info"]["input_token_logprobs"],
        want["meta_info"]["input_token_logprobs"],
    )
    assert [t for _, t, _ in got_in] == [t for _, t, _ in want_in] == body["input_ids"]
    assert got_in[0][0] is None
    assert [lp for lp, _, _ in got_in[1:]] == pytest.approx(
        [lp for lp, _, _ in want_in[1:]], abs=1e-4
    )
    got_top = [[t for _, t, _ in top] for top in got["meta_info"]["input_top_logprobs"][1:]]
    want_top = [[t for _, t, _ in top] for top in want["meta_info"]["input_top_logprobs"][1:]]
    assert got_top == want_top
    _idle(pd)


def test_overlapping_sample_rooms_are_refused(pd):
    room = 1 << 40
    body = {
        "text": ["a", "b"],
        "sampling_params": {"max_new_tokens": 2, "n": 2, "temperature": 0.5},
        "bootstrap_host": ["127.0.0.1"] * 2,
        "bootstrap_port": [pd.bootstrap_port] * 2,
        "bootstrap_room": [room, room + 1],  # the first prompt's samples take room and room + 1
    }
    response = httpx.post(f"{pd.decode.url}/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert "overlap" in response.json()["error"]["message"]
    _idle(pd)
