"""Prompt logprobs on /generate (SGLang's ``logprob_start_len``): each equals the logprob the
model gives that token as the next one after the tokens before it, across prefill chunks,
with the prompt's prefix cached or not, in batches and with n samples."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_process import ServerProcess

TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.fixture(scope="module")
def chunked_server(embedded_ready, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-total-tokens",
        "6000",
        "--context-length",
        "2048",
        "--chunked-prefill-size",
        "8",  # the prompt spans several chunks
        log=tmp_path_factory.mktemp("prompt-logprobs") / "server.log",
    )
    yield proc
    proc.stop()


def _generate(server: ServerProcess, **body) -> dict | list:
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _next_token_logprobs(server: ServerProcess, ids: list[int]) -> dict[int, float]:
    """The top-20 next-token logprobs after ``ids`` (the model's own output logprobs)."""
    meta = _generate(
        server,
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=20,
    )["meta_info"]
    return {t: lp for lp, t, _ in meta["output_top_logprobs"][0]}


def _prompt_ids(server: ServerProcess) -> list[int]:
    meta = _generate(
        server,
        text=TEXT,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )["meta_info"]
    return [token for _, token, _ in meta["input_token_logprobs"]]


def test_prompt_logprobs_equal_next_token_logprobs(chunked_server):
    prompt = _prompt_ids(chunked_server)
    start = 4
    meta = _generate(
        chunked_server,
        text=TEXT,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
        return_text_in_logprobs=True,
    )["meta_info"]
    entries = meta["input_token_logprobs"]
    assert meta["prompt_tokens"] == len(prompt) and len(entries) == len(prompt) - start
    assert [token for _, token, _ in entries] == prompt[start:]
    compared = 0
    for position, (logprob, token, text) in enumerate(entries, start=start):
        assert isinstance(text, str) and logprob <= 0
        tops = _next_token_logprobs(chunked_server, prompt[:position])
        if token in tops:
            assert logprob == pytest.approx(tops[token], abs=2e-3), position
            compared += 1
    assert compared >= len(entries) // 2


def test_start_zero_has_no_logprob_for_the_first_token_and_cache_changes_nothing(chunked_server):
    body = {
        "text": TEXT,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    first = _generate(chunked_server, **body)["meta_info"]
    again = _generate(chunked_server, **body)["meta_info"]  # the prompt is cached now
    assert first["input_token_logprobs"][0][0] is None
    assert len(first["input_token_logprobs"]) == first["prompt_tokens"]
    assert [e[1] for e in again["input_token_logprobs"]] == [
        e[1] for e in first["input_token_logprobs"]
    ]
    assert [e[0] for e in again["input_token_logprobs"][1:]] == pytest.approx(
        [e[0] for e in first["input_token_logprobs"][1:]], abs=1e-4
    )
    assert len(again["input_top_logprobs"][1]) == 3
    late = {**body, "logprob_start_len": first["prompt_tokens"] - 3}
    tail = _generate(chunked_server, **late)["meta_info"]
    assert tail["cached_tokens"] > 0  # the prefix before the scored part came from the cache
    assert [e[0] for e in tail["input_token_logprobs"]] == pytest.approx(
        [e[0] for e in first["input_token_logprobs"][-3:]], abs=1e-4
    )


def test_batch_and_without_return_logprob(chunked_server):
    texts = [TEXT, "Hello world, this is a test of prompt logprobs."]
    replies = _generate(
        chunked_server,
        text=texts,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=1,
    )
    assert [len(r["meta_info"]["input_token_logprobs"]) for r in replies] == [
        r["meta_info"]["prompt_tokens"] - 1 for r in replies
    ]
    plain = _generate(
        chunked_server, text=TEXT, sampling_params={"max_new_tokens": 0}, logprob_start_len=0
    )
    assert "input_token_logprobs" not in plain["meta_info"]
    chunked_server.wait_idle_and_free()
