"""Every query of the HiCache dashboard returns data from a real Prometheus scraping two
real ``kvflow serve`` with the host tier and a shared file store (loopback; see
prometheus_stack.py): the first fills its device pool past capacity (device to host), comes
back to its first prompts (host hits, loaded back) and writes the store; the second then
serves the same prompts from the store (prefetch, storage reads)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from prometheus_stack import (
    PROMETHEUS,
    Prometheus,
    dead_panels,
    empty_variables,
    patient_server_start,
)
from server_process import ServerProcess

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus package is not installed (scripts/setup.sh)"
)
FILLER = " ".join(f"w{j}" for j in range(220))


def complete(url: str, i: int) -> None:
    body = {"model": "x", "prompt": f"Document {i}: {FILLER}", "max_tokens": 4}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def hicache_prometheus(model_path, tmp_path_factory) -> Iterator[tuple[Prometheus, float]]:
    logs = tmp_path_factory.mktemp("dashboards-hicache")
    store = logs / "store"
    store.mkdir()
    flags = (
        "--max-total-tokens", "1500", "--context-length", "2048",
        "--hicache-host-memory-gb", "0.5",  # ~11,000 tokens: nothing leaves the host
        "--hicache-storage", "file", "--hicache-storage-path", str(store),
    )  # fmt: skip
    started: list[ServerProcess] = []
    prometheus = None
    try:
        with patient_server_start():  # one after the other: the machine has 2 cores
            started.append(ServerProcess(*flags, log=logs / "a.log"))
            started.append(ServerProcess(*flags, log=logs / "b.log"))
        a, b = started
        prometheus = Prometheus(
            {
                "runtime": [
                    (a.url.removeprefix("http://"), "serve-a"),
                    (b.url.removeprefix("http://"), "serve-b"),
                ]
            },
            logs,
        )
        prometheus.wait_scraped(jobs=1)
        for i in range(10):  # ~2,500 prompt tokens through a 1,500-token device pool
            complete(a.url, i)
        for i in range(3, 6):  # evicted from the device, still on the host
            complete(a.url, i)
        time.sleep(3)  # the store writes run in the background
        for i in range(7, 10):  # never seen by b: read from the shared store
            complete(b.url, i)
        time.sleep(4)
        yield prometheus, time.time()
    finally:
        if prometheus is not None:
            prometheus.stop()
        for server in started:
            server.stop()


def test_every_hicache_panel_query_returns_data(hicache_prometheus) -> None:
    prometheus, at = hicache_prometheus
    dead, checked = dead_panels(prometheus, "kvflow-hicache", at)
    assert not dead, "\n".join(dead)
    assert checked >= 10


def test_hits_come_from_every_tier(hicache_prometheus) -> None:
    prometheus, at = hicache_prometheus
    expr = 'sum by (tier) (increase(kvflow:hicache_hit_tokens_total{namespace="kvflow-test"}[5m]))'
    result = prometheus.query(expr, at)["data"]["result"]
    hits = {r["metric"]["tier"]: float(r["value"][1]) for r in result}
    assert hits["host"] > 0 and hits["storage"] > 0, hits


def test_hicache_variable_queries_return_values(hicache_prometheus) -> None:
    prometheus, _ = hicache_prometheus
    assert not empty_variables(prometheus, "kvflow-hicache")
