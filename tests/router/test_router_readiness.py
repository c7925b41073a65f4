"""``GET /readiness``: the router's own report that it can serve every role it needs.

The operator makes it the router pod's readiness probe, so a ModelDeployment is only Ready
while its router has a healthy worker of each role. Workers here are stand-ins that answer
``/health`` (what the router's health checks read); dead URLs are ports nobody listens on.
"""

from __future__ import annotations

import time

import httpx
from fake_worker import FakeWorker
from router_process import FAST_FAULTS, RouterProcess
from server_process import free_port

from kvflow import contract


def readiness(router: RouterProcess) -> httpx.Response:
    return httpx.get(f"{router.url}{contract.ROUTER_READINESS_PATH}", timeout=10)


def wait_status(router: RouterProcess, status: int, timeout: float = 30) -> httpx.Response:
    deadline = time.monotonic() + timeout
    answer = readiness(router)
    while answer.status_code != status and time.monotonic() < deadline:
        time.sleep(0.1)
        answer = readiness(router)
    assert answer.status_code == status, answer.text
    return answer


def test_unified_router_is_ready_only_with_a_healthy_worker(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess("--worker-urls", dead, *FAST_FAULTS, log=tmp_path / "router.log")
    worker = FakeWorker("unified")
    try:
        refused = wait_status(router, 503)  # once its health checks fail
        assert "no healthy unified worker" in refused.json()["error"]["message"]
        added = httpx.post(f"{router.url}/workers", json={"url": worker.url}, timeout=10)
        assert added.status_code == 201
        ready = wait_status(router, 200)
        assert ready.json() == {"status": "ready", "available": {"unified": 1}}
    finally:
        router.stop()
        worker.stop()


def test_pd_router_needs_both_roles_and_answers_without_the_api_key(tmp_path):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess(
        "--prefill-urls",
        f"{prefill.url}#{free_port()}",
        "--decode-urls",
        dead,
        *FAST_FAULTS,
        log=tmp_path / "router.log",
        env={contract.API_KEY_ENV: "s3cret"},
    )
    try:
        refused = wait_status(router, 503)
        message = refused.json()["error"]["message"]
        assert "no healthy decode worker" in message and "prefill" not in message
        # The admin API is behind the key; the probe is not (the kubelet sends none).
        headers = {"Authorization": "Bearer s3cret"}
        body = {"url": decode.url, "role": "decode"}
        added = httpx.post(f"{router.url}/workers", json=body, headers=headers, timeout=10)
        assert added.status_code == 201
        ready = wait_status(router, 200)
        assert ready.json()["available"] == {"prefill": 1, "decode": 1}
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
