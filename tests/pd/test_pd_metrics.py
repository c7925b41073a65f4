"""The prefill counts the KV bytes it writes and times each write; the queue gauges of both
roles return to 0 when idle."""

from __future__ import annotations

import time

import httpx
import pytest
from router_process import worker_counter

pytestmark = pytest.mark.slow

# The embedded model (SmolLM2-135M) in float32: layers x (K and V) x KV heads x head_dim x 4 B.
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
QUEUES = (
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)


def _wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_transfer_bytes_and_seconds_grow_by_the_prompt(pd):
    prefill = pd.prefill.url
    bytes_before = worker_counter(prefill, "kvflow:kv_transfer_bytes_total")
    writes_before = worker_counter(prefill, "kvflow:kv_transfer_seconds_count")
    body = {
        "messages": [{"role": "user", "content": "Name three colours of boxes."}],
        "temperature": 0,
        "max_tokens": 4,
    }
    response = httpx.post(f"{pd.router.url}/v1/chat/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    want = bytes_before + prompt_tokens * BYTES_PER_TOKEN
    # the HTTP process hears the scheduler's totals every 0.25 s
    _wait_for(
        lambda: worker_counter(prefill, "kvflow:kv_transfer_bytes_total") == want,
        f"transfer bytes != {want}",
    )
    assert worker_counter(prefill, "kvflow:kv_transfer_seconds_count") == writes_before + 1
    assert worker_counter(prefill, "kvflow:kv_transfer_seconds_sum") > 0
    assert worker_counter(prefill, "sglang:kv_transfer_speed_gb_s") > 0
    assert worker_counter(pd.decode.url, "kvflow:kv_transfer_bytes_total") == 0
    for url in (prefill, pd.decode.url):
        _wait_for(lambda url=url: sum(worker_counter(url, q) for q in QUEUES) == 0, f"{url} queues")
    pd.decode.wait_idle_and_free(timeout=30)
    pd.prefill.wait_idle_and_free(timeout=30)


def test_a_long_prompt_is_sent_chunk_by_chunk_exactly_once(pd):
    """A prompt of several 64-token chunks: its KV leaves in more than one write (chunks go
    out while later ones are computed), and the writes cover the prompt exactly once."""
    prefill = pd.prefill.url
    bytes_before = worker_counter(prefill, "kvflow:kv_transfer_bytes_total")
    writes_before = worker_counter(prefill, "kvflow:kv_transfer_seconds_count")
    words = " ".join(f"w{i}" for i in range(150))
    body = {"prompt": f"Repeat: {words}", "temperature": 0, "max_tokens": 2}
    response = httpx.post(f"{pd.router.url}/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 4 * 64
    want = bytes_before + prompt_tokens * BYTES_PER_TOKEN
    _wait_for(
        lambda: worker_counter(prefill, "kvflow:kv_transfer_bytes_total") == want,
        f"transfer bytes != {want}",
    )
    assert worker_counter(prefill, "kvflow:kv_transfer_seconds_count") >= writes_before + 2
    unified = httpx.post(f"{pd.unified.url}/v1/completions", json=body, timeout=180).json()
    assert response.json()["choices"][0]["text"] == unified["choices"][0]["text"]
    pd.decode.wait_idle_and_free(timeout=30)
    pd.prefill.wait_idle_and_free(timeout=30)
