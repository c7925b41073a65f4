"""``/health_generate`` in PD mode: the prefill and the decode each run their own probe
through their model (no bootstrap room, nothing transferred), and a PD router answers 200
only while a prefill and a decode both pass theirs (own stack: the prefill gets killed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import httpx
import pytest
from pd_flags import COMMON
from router_process import RouterProcess
from server_process import ServerProcess, free_port
from sglang_router_process import start_sglang_router

pytestmark = pytest.mark.slow

PROBE_TIMEOUT_S = 120  # a loaded 2-core machine; the probe itself is one or two tokens


class Pair(NamedTuple):
    prefill: ServerProcess
    bootstrap_port: int
    decode: ServerProcess
    router: RouterProcess


@pytest.fixture(scope="module")
def pair(model_path, tmp_path_factory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("pd-health")
    bootstrap_port = free_port()
    prefill_flags = ("--role", "prefill", "--bootstrap-port", str(bootstrap_port), *COMMON)
    with ThreadPoolExecutor(2) as pool:
        prefill_f = pool.submit(ServerProcess, *prefill_flags, log=logs / "prefill.log")
        decode_f = pool.submit(ServerProcess, "--role", "decode", *COMMON, log=logs / "decode.log")
    started = [f.result() for f in (prefill_f, decode_f) if f.exception() is None]
    router = None
    try:
        prefill, decode = prefill_f.result(), decode_f.result()
        router = RouterProcess(
            "--prefill-urls",
            f"{prefill.url}#{bootstrap_port}",
            "--decode-urls",
            decode.url,
            log=logs / "router.log",
        )
        yield Pair(prefill, bootstrap_port, decode, router)
    finally:
        if router is not None:
            router.stop()
        for proc in started:
            proc.stop()


def _health_generate(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health_generate", timeout=PROBE_TIMEOUT_S, trust_env=False)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_role_runs_its_own_probe(pair, role):
    worker = getattr(pair, role)
    response = _health_generate(worker.url)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok", "role": role}
    info = worker.wait_idle_and_free(timeout=30)
    stats = info["stats"]
    # the probe claimed no room and moved no KV
    assert stats["kv_transfers"] == 0 and stats["kv_transfer_failures"] == 0
    assert stats["num_prefill_inflight_queue_reqs"] == 0
    assert stats["num_decode_prealloc_queue_reqs"] == 0
    assert stats["num_decode_transfer_queue_reqs"] == 0


def test_a_probe_is_not_a_way_around_the_bootstrap_fields(pair):
    """Clients still cannot run a request on a PD role without a room."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1}}
    for worker in (pair.prefill, pair.decode):
        response = httpx.post(f"{worker.url}/generate", json=body, timeout=60)
        assert response.status_code == 400
        assert "bootstrap" in response.json()["error"]["message"]


def test_pd_router_passes_with_a_prefill_and_a_decode(pair):
    response = _health_generate(pair.router.url)
    assert response.status_code == 200, response.text


def test_sglang_router_health_generate_passes(pair, tmp_path_factory):
    """sglang-router's PD health_generate probes a prefill/decode pair on its own."""
    log = tmp_path_factory.mktemp("sglang-router-health") / "router.log"
    router = start_sglang_router(pair.prefill.url, pair.bootstrap_port, pair.decode.url, log)
    try:
        response = _health_generate(router.url)
        assert response.status_code == 200, (response.text, router.tail())
    finally:
        router.stop()


def test_killed_prefill_fails_the_router_probe_in_bounded_time(pair):
    """Last in the module: it kills the prefill."""
    pair.prefill.proc.kill()
    pair.prefill.proc.wait(10)
    start = time.monotonic()
    response = _health_generate(pair.router.url)
    elapsed = time.monotonic() - start
    assert response.status_code == 503, response.text
    assert "prefill" in response.json()["error"]["message"]
    assert elapsed < 10, elapsed
    assert _health_generate(pair.decode.url).status_code == 200  # the decode alone is fine
