"""SGLang's own router (PyPI sglang-router 0.3.2, unchanged) drives a kvflow prefill/decode
pair: greedy output through it equals the unified server's, and it registers both workers
without a probe answered 404.

What the router sends (seen through a TCP capture in front of both workers): at
registration ``GET /health``, an HTTP/2 preface (its gRPC probe; uvicorn answers 400 and it
falls back to HTTP), ``/server_info`` then ``/get_server_info``, ``/model_info`` then
``/get_model_info``; per request the same body to both workers plus ``bootstrap_host``,
``bootstrap_port`` (the one given with ``--prefill``) and ``bootstrap_room`` (a random
63-bit integer). Chat bodies get ``model: "unknown"``, ``max_completion_tokens``,
``separate_reasoning``, ``no_stop_trim``, ...; ``/generate`` bodies get ``model``,
``return_text_in_logprobs``, ``log_metrics``, ``return_hidden_states``, ``background``,
``no_logs``, ``return_bytes``, ``return_entropy`` (all false).
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
# Longer than the 64-token chunk: the prefill runs it in several chunks.
LONG = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))
TIMEOUT_S = 180


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT_S, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def _chat(url: str, content: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
    return _post(url, "/v1/chat/completions", body)


def _idle(pd) -> None:
    pd.decode.wait_idle_and_free(timeout=30)
    pd.prefill.wait_idle_and_free(timeout=30)


def test_registers_both_workers_without_404(sglang_router):
    log = sglang_router.log.read_text(errors="replace")
    assert "returned 404" not in log, sglang_router.tail()


@pytest.mark.parametrize("content", [QUESTION, LONG + " How many boxes are blue?"])
def test_greedy_chat_through_sglang_router_equals_unified(pd, sglang_router, content):
    want = _chat(pd.unified.url, content, max_tokens=24)
    got = _chat(sglang_router.url, content, max_tokens=24)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    _idle(pd)


def test_streamed_chat_through_sglang_router_equals_unified(pd, sglang_router):
    want = _chat(pd.unified.url, QUESTION, max_tokens=16)["choices"][0]["message"]["content"]
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 16,
        "stream": True,
    }
    text = ""
    with httpx.stream(
        "POST",
        f"{sglang_router.url}/v1/chat/completions",
        json=body,
        timeout=TIMEOUT_S,
        trust_env=False,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                for choice in json.loads(line[5:])["choices"]:
                    text += (choice.get("delta") or {}).get("content") or ""
    assert text == want
    _idle(pd)


def test_native_generate_through_sglang_router_equals_unified(pd, sglang_router):
    body = {
        "input_ids": list(range(2000, 2100)),
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    want = _post(pd.unified.url, "/generate", body)
    got = _post(sglang_router.url, "/generate", body)
    assert got["output_ids"] == want["output_ids"]
    assert got["text"] == want["text"]
    _idle(pd)


def test_logprobs_through_sglang_router_equal_unified(pd, sglang_router):
    """Output and prompt logprobs: sglang-router merges the prefill's and the decode's
    ``meta_info``; the result is unified's."""
    body = {
        "input_ids": list(range(2000, 2080)),
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    want = _post(pd.unified.url, "/generate", body)["meta_info"]
    got = _post(sglang_router.url, "/generate", body)["meta_info"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert [t for _, t, _ in got[key]] == [t for _, t, _ in want[key]], key
        lps = [lp for lp, _, _ in got[key][1:]]
        assert lps == pytest.approx([lp for lp, _, _ in want[key][1:]], abs=1e-4), key
    _idle(pd)


def test_sglang_output_switches_other_than_false_are_refused(pd):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}, "return_hidden_states": True}
    response = httpx.post(f"{pd.unified.url}/generate", json=body, timeout=30, trust_env=False)
    assert response.status_code == 400
    assert "return_hidden_states" in response.json()["error"]["message"]
    card = httpx.get(f"{pd.unified.url}/get_model_info", timeout=30, trust_env=False).json()
    assert card["is_generation"] is True and card["model_path"]
