"""The official ``openai`` client through ``kvflow router`` over two real workers."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import openai
import pytest
from router_process import FAST_FAULTS, RouterProcess, worker_counter
from server_process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "router-s3cret"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    urls = ",".join(w.url for w in workers)
    proc = RouterProcess(
        "--worker-urls",
        urls,
        "--policy",
        "round_robin",
        log=tmp_path_factory.mktemp("router") / "router.log",
    )
    yield proc
    proc.stop()


def client(router: RouterProcess, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=300)


def test_chat_streaming_completions_and_n(router):
    api = client(router)
    model = api.models.list().data[0].id
    chat = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    stream = api.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    done = api.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, n=2, temperature=0.8, seed=1
    )
    assert len(done.choices) == 2 and {c.index for c in done.choices} == {0, 1}


def test_round_robin_spreads_requests_over_workers(router, workers):
    before = [worker_counter(w.url, "sglang:num_requests_total") for w in workers]
    api = client(router)
    for i in range(4):
        api.completions.create(model="m", prompt=f"Count to {i}:", max_tokens=2, temperature=0)
    after = [worker_counter(w.url, "sglang:num_requests_total") for w in workers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]


def test_request_id_worker_listing_and_metrics(router, workers):
    response = httpx.post(
        f"{router.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 1},
        headers={"X-Request-Id": "trace-me-42"},
        timeout=120,
    )
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "trace-me-42"
    assert httpx.post(
        f"{router.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=120
    ).headers["X-Request-Id"]
    listing = router.workers()
    assert set(listing) == {w.url for w in workers}
    assert all(
        w["healthy"] and w["breaker"] == "closed" and w["role"] == "unified"
        for w in listing.values()
    )
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'kvflow_router_requests_total{route="/v1/completions"' in metrics
    assert "kvflow_router_upstream_ttfb_seconds_bucket" in metrics
    assert httpx.get(f"{router.url}/health_generate", timeout=120).status_code == 200


def test_worker_4xx_is_forwarded_unchanged(router, workers):
    bad = {"messages": QUESTION, "max_tokens": -5}
    direct = httpx.post(f"{workers[0].url}/v1/chat/completions", json=bad, timeout=60)
    routed = httpx.post(f"{router.url}/v1/chat/completions", json=bad, timeout=60)
    assert direct.status_code == routed.status_code == 400
    assert routed.json() == direct.json()


def test_api_key_is_enforced(workers, tmp_path):
    keyed = RouterProcess(
        "--worker-urls",
        workers[0].url,
        "--policy",
        "round_robin",
        log=tmp_path / "router.log",
        env={"KVFLOW_API_KEY": KEY},
    )
    try:
        assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
        wrong = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
        assert httpx.get(f"{keyed.url}/workers").status_code == 401
        assert httpx.get(f"{keyed.url}/health").status_code == 200
        assert httpx.get(f"{keyed.url}/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(keyed, "nope").models.list()
        chat = client(keyed, KEY).chat.completions.create(
            model="m", messages=QUESTION, max_tokens=2
        )
        assert chat.choices[0].message.content
    finally:
        keyed.stop()


def test_no_healthy_worker_is_a_503_and_the_admin_api_adds_one(workers, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = RouterProcess("--worker-urls", dead, *FAST_FAULTS, log=tmp_path / "router.log")
    body = {"messages": QUESTION, "max_tokens": 2}
    try:
        refused = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code in (502, 503), refused.text
        router.wait_for(lambda ws: not ws[dead]["healthy"], "the dead worker unhealthy", 30)
        refused = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 503
        assert "no healthy unified worker" in refused.json()["error"]["message"]

        added = httpx.post(f"{router.url}/workers", json={"url": workers[0].url}, timeout=10)
        assert added.status_code == 201 and added.json()["role"] == "unified"
        assert (
            httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=120).status_code
            == 200
        )
        gone = httpx.delete(f"{router.url}/workers/{quote(dead, safe='')}", timeout=10)
        assert gone.status_code == 200
        assert set(router.workers()) == {workers[0].url}
        assert (
            httpx.delete(f"{router.url}/workers/{quote(dead, safe='')}", timeout=10).status_code
            == 404
        )
        assert (
            httpx.post(f"{router.url}/workers", json={"role": "x"}, timeout=10).status_code == 400
        )
    finally:
        router.stop()


def test_the_admin_routes_need_the_internal_key_and_a_dead_worker_starts_unhealthy(
    workers, tmp_path
):
    """With the internal key the routes that change the worker set take it and nothing else
    (clients hold the API key, not it); the list is read with the API key like the model
    routes; a worker added on a dead port is reported unhealthy at once and takes no
    traffic."""
    keyed = RouterProcess(
        "--worker-urls",
        workers[0].url,
        log=tmp_path / "router.log",
        env={"KVFLOW_API_KEY": KEY, "KVFLOW_INTERNAL_KEY": "admin-key"},
    )
    admin = {"Authorization": "Bearer admin-key"}
    dead = f"http://127.0.0.1:{free_port()}"
    api = {"Authorization": f"Bearer {KEY}"}
    try:
        assert httpx.get(f"{keyed.url}/workers").status_code == 401
        for headers in ({}, api):
            refused = httpx.post(f"{keyed.url}/workers", json={"url": dead}, headers=headers)
            assert refused.status_code == 401, refused.text
            gone = httpx.delete(
                f"{keyed.url}/workers/{quote(workers[0].url, safe='')}", headers=headers
            )
            assert gone.status_code == 401, gone.text
        assert set(keyed.workers(api)) == {workers[0].url}
        added = httpx.post(f"{keyed.url}/workers", json={"url": dead}, headers=admin, timeout=10)
        assert added.status_code == 201 and added.json()["healthy"] is False
        assert added.json()["last_error"]
        for _ in range(3):  # round robin would pick it half the time were it healthy
            chat = client(keyed, KEY).chat.completions.create(
                model="m", messages=QUESTION, max_tokens=2
            )
            assert chat.choices[0].message.content
        gone = httpx.delete(f"{keyed.url}/workers/{quote(dead, safe='')}", headers=admin)
        assert gone.status_code == 200
        # the model routes still take the API key, not the internal one
        assert httpx.get(f"{keyed.url}/v1/models", headers=admin).status_code == 401
    finally:
        keyed.stop()


def test_the_admin_routes_can_have_their_own_port(workers, tmp_path):
    """--admin-port: /workers answers there (loopback, no key set) and not on the API port."""
    admin_port = free_port()
    router = RouterProcess(
        "--worker-urls",
        workers[0].url,
        "--admin-port",
        str(admin_port),
        log=tmp_path / "router.log",
    )
    try:
        assert httpx.get(f"{router.url}/workers", timeout=10).status_code == 404
        listing = httpx.get(f"http://127.0.0.1:{admin_port}/workers", timeout=10).json()
        assert [w["url"] for w in listing["workers"]] == [workers[0].url]
        chat = client(router, "unused").chat.completions.create(
            model="m", messages=QUESTION, max_tokens=2
        )
        assert chat.choices[0].message.content
    finally:
        router.stop()
