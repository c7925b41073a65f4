"""How the router relays a stream, and what its /metrics leaves out.

A stand-in worker (``fake_worker.py``) controls what a real one cannot: a stream whose
headers leave long before its first event. The router may send the status line and headers
in one write with the first event, but only when that event already came with them: a
client never waits for the headers because the first token is late.
"""

from __future__ import annotations

import time

import httpx
from fake_worker import FakeWorker
from prometheus_client.parser import text_string_to_metric_families
from router_process import RouterProcess

STREAM = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_headers_are_not_held_back_for_a_late_first_event(tmp_path):
    worker = FakeWorker("late")
    worker.first_event_delay_s = 1.5
    router = RouterProcess(
        "--worker-urls", worker.url, "--policy", "cache_aware", log=tmp_path / "router.log"
    )
    try:
        start = time.monotonic()
        with httpx.stream(
            "POST", f"{router.url}/v1/chat/completions", json=STREAM, timeout=30
        ) as response:
            headers_after = time.monotonic() - start
            assert response.status_code == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            body = b"".join(response.iter_raw())
            body_after = time.monotonic() - start
        assert headers_after < 1.0, headers_after  # not waiting for the first event
        assert body_after >= 1.5
        assert body == b'data: {"text": "from "}\n\ndata: {"text": "late"}\n\ndata: [DONE]\n\n'
        # Without a delay the stream is the same, headers and events in any grouping.
        worker.first_event_delay_s = 0.0
        again = httpx.post(f"{router.url}/v1/chat/completions", json=STREAM, timeout=30)
        assert again.status_code == 200 and again.content == body
    finally:
        router.stop()
        worker.stop()


def test_each_request_is_logged_with_its_id(tmp_path):
    # Request lines wait in a buffer for at most logs.FLUSH_INTERVAL_S (0.2 s).
    worker = FakeWorker("logged")
    log = tmp_path / "router.log"
    router = RouterProcess("--worker-urls", worker.url, "--policy", "round_robin", log=log)
    try:
        for i in range(3):
            answer = httpx.post(
                f"{router.url}/generate",
                json={"text": "hi"},
                headers={"X-Request-Id": f"trace-log-{i}"},
                timeout=30,
            )
            assert answer.status_code == 200
        deadline = time.monotonic() + 5
        while "rid=trace-log-2 " not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [line for line in log.read_text().splitlines() if "rid=trace-log-" in line]
        assert len(lines) == 3 and all(" INFO kvflow.router: " in line for line in lines)
        assert "/generate -> " + worker.url in lines[0] and "status=200" in lines[0]
    finally:
        router.stop()
        worker.stop()


def test_redirects_go_back_and_request_headers_are_the_clients(tmp_path):
    worker = FakeWorker("plain")
    router = RouterProcess(
        "--worker-urls", worker.url, "--policy", "round_robin", log=tmp_path / "router.log"
    )
    try:
        url = f"{router.url}/generate"
        plain = httpx.post(url, json={"text": "a"}, headers={"Accept-Encoding": ""}, timeout=30)
        encoded = httpx.post(url, json={"text": "b"}, headers={"Accept-Encoding": "br"}, timeout=30)
        assert plain.status_code == encoded.status_code == 200
        seen = [{k.lower(): v for k, v in h.items()} for h in worker.headers]
        # The client's Accept-Encoding as it is, no router's own; no router User-Agent.
        assert [h["accept-encoding"] for h in seen] == ["", "br"]
        assert all("user-agent" not in h for h in seen)
        worker.redirect_to = "http://elsewhere.invalid/generate"
        moved = httpx.post(url, json={"text": "c"}, timeout=30)  # httpx does not follow
        assert moved.status_code == 307
        assert moved.headers["Location"] == "http://elsewhere.invalid/generate"
        assert len(worker.bodies) == 3  # the router did not follow it either
    finally:
        router.stop()
        worker.stop()


def test_metrics_have_no_created_series(tmp_path):
    worker = FakeWorker("plain")
    router = RouterProcess(
        "--worker-urls", worker.url, "--policy", "round_robin", log=tmp_path / "router.log"
    )
    try:
        body = {"text": "hi"}
        assert httpx.post(f"{router.url}/generate", json=body, timeout=30).status_code == 200
        text = httpx.get(f"{router.url}/metrics", timeout=10).text
        samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        assert "kvflow_router_requests_total" in samples
        assert "kvflow_router_upstream_latency_seconds_bucket" in samples
        assert not [name for name in samples if name.endswith("_created")], samples
    finally:
        router.stop()
        worker.stop()
