"""Prefill/decode disaggregation on the embedded model: greedy output through router ->
prefill -> decode equals unified serving token for token; faults end requests with an
error in bounded time and leave both sides idle."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
# Longer than the 64-token chunk: the prefill runs it in several chunks.
LONG = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))


def _chat(url: str, content: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def _idle(pd) -> None:
    pd.decode.wait_idle_and_free(timeout=30)
    pd.prefill.wait_idle_and_free(timeout=30)


@pytest.mark.parametrize("content", [QUESTION, LONG + " How many boxes are blue?"])
def test_greedy_chat_through_pd_equals_unified(pd, content):
    want = _chat(pd.unified.url, content, max_tokens=24)
    got = _chat(pd.router.url, content, max_tokens=24)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    _idle(pd)


def test_prefix_hits_on_the_prefill_side(pd):
    prompt = LONG + " Which item is the last one?"
    first = _chat(pd.router.url, prompt, max_tokens=8)
    again = _chat(pd.router.url, prompt, max_tokens=8)
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    _idle(pd)


def test_generate_ids_stop_strings_and_logprobs_through_pd(pd):
    ids = list(range(2000, 2100))
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    want = httpx.post(f"{pd.unified.url}/generate", json=body, timeout=180).json()
    got = httpx.post(f"{pd.router.url}/generate", json=body, timeout=180).json()
    assert got["output_ids"] == want["output_ids"]
    got_lp = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
    want_lp = [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    stop_want = _chat(pd.unified.url, QUESTION, max_tokens=24, stop=["Paris"])
    stop_got = _chat(pd.router.url, QUESTION, max_tokens=24, stop=["Paris"])
    assert stop_got["choices"][0]["message"] == stop_want["choices"][0]["message"]
    assert stop_got["choices"][0]["finish_reason"] == "stop"
    _idle(pd)


def test_openai_streaming_through_pd(pd):
    client = OpenAI(base_url=f"{pd.router.url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want = _chat(pd.unified.url, QUESTION, max_tokens=16)
    assert text == want["choices"][0]["message"]["content"]
    assert chunks[-1].usage.completion_tokens == want["usage"]["completion_tokens"]
    _idle(pd)


def test_many_concurrent_requests_complete_without_leaks(pd):
    import asyncio

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(i: int) -> int:
                body = {
                    "messages": [{"role": "user", "content": f"Count to {i % 7 + 2}."}],
                    "temperature": 0,
                    "max_tokens": 8,
                }
                response = await client.post(f"{pd.router.url}/v1/chat/completions", json=body)
                return response.status_code

            return await asyncio.gather(*(one(i) for i in range(100)))

    codes = asyncio.run(run())
    assert codes == [200] * 100
    _idle(pd)


def _bootstrap(host: str, port: int) -> dict:
    return {
        "bootstrap_host": host,
        "bootstrap_port": port,
        "bootstrap_room": random.getrandbits(63),
    }


def _signed(host: str, port: int) -> dict:
    """Bootstrap fields with the pair's token, as the deployment's router signs them."""
    from pd_flags import PD_INTERNAL_KEY

    from kvflow.runtime.wire import Bootstrap
    from kvflow.runtime.wire.pair_token import sign_pair

    fields = _bootstrap(host, port)
    pair = Bootstrap(host, port, fields["bootstrap_room"])
    return {**fields, "bootstrap_token": sign_pair(PD_INTERNAL_KEY, pair)}


def test_unreachable_prefill_fails_the_decode_request_in_bounded_time(pd):
    from server_process import free_port

    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        **_signed("127.0.0.1", free_port()),  # a pair the router signed; nothing listens
    }
    start = time.monotonic()
    response = httpx.post(f"{pd.decode.url}/v1/chat/completions", json=body, timeout=60)
    elapsed = time.monotonic() - start
    # nothing was sent yet: a 503 that a router may retry on another pair
    assert response.status_code == 503, response.text
    assert "prefill" in response.json()["error"]["message"]
    assert elapsed < 10
    _idle(pd)


def test_unclaimed_room_is_freed_on_the_prefill(pd):
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        **_bootstrap("127.0.0.1", pd.bootstrap_port),  # no decode will claim it
    }
    response = httpx.post(f"{pd.prefill.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    _idle(pd)  # the parked KV is released once the room times out


def test_requests_without_pairing_are_refused_by_pd_workers(pd):
    for server in (pd.prefill, pd.decode):
        body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400
        assert "PD router" in response.json()["error"]["message"]
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    body.update(_bootstrap("127.0.0.1", pd.bootstrap_port))
    response = httpx.post(f"{pd.unified.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "unified" in response.json()["error"]["message"]


def test_a_decode_contacts_no_prefill_its_router_did_not_sign(pd):
    """Server-side request forgery: a client names a listener (a capture socket here) as
    the prefill. Unsigned, forged, re-used for another room or signed with another key:
    each is a 400 before the decode connects anywhere."""
    import socket

    from kvflow.runtime.wire import Bootstrap
    from kvflow.runtime.wire.pair_token import sign_pair

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        signed = _signed("127.0.0.1", port)
        other_room = {**signed, "bootstrap_room": signed["bootstrap_room"] + 1}
        other_key = {
            **signed,
            "bootstrap_token": sign_pair(
                "not-the-key", Bootstrap("127.0.0.1", port, signed["bootstrap_room"])
            ),
        }
        unsigned = _bootstrap("127.0.0.1", port)
        forged = {**unsigned, "bootstrap_token": "v1.9999999999.00"}
        for fields in (unsigned, forged, other_room, other_key):
            body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
            response = httpx.post(
                f"{pd.decode.url}/v1/chat/completions", json={**body, **fields}, timeout=30
            )
            assert response.status_code == 400, response.text
            assert "bootstrap" in response.json()["error"]["message"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    _idle(pd)


def _failed_transfers(pd) -> float:
    text = httpx.get(f"{pd.prefill.url}/metrics", timeout=10).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("sglang:num_transfer_failed_reqs_total")
    )


def test_a_sustained_stream_through_the_router_loses_nothing(pd):
    """240 requests at a fixed 12 per second through router -> prefill -> decode (prompts of
    20-150 tokens: up to three prefill chunks and KV writes each): every one answers 200
    with its tokens, no KV write fails, and both sides end idle with their KV free."""
    import asyncio

    rng = random.Random(29)
    failed_before = _failed_transfers(pd)

    async def one(client: httpx.AsyncClient, delay: float) -> httpx.Response:
        await asyncio.sleep(delay)
        ids = [rng.randrange(1000, 40000) for _ in range(rng.randrange(20, 150))]
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        }
        return await client.post(f"{pd.router.url}/generate", json=body)

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i / 12) for i in range(240)))

    responses = asyncio.run(asyncio.wait_for(run(), timeout=300))
    bad = [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
    assert not bad, bad[:3]
    assert all(len(r.json()["output_ids"]) == 4 for r in responses)
    time.sleep(0.5)  # the prefill publishes its stats every 0.25 s
    assert _failed_transfers(pd) == failed_before
    _idle(pd)
