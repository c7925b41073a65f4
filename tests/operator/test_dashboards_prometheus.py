"""Every query of the overview, KV cache, router and autoscaler dashboards returns data
from a real Prometheus (PD and HiCache: test_dashboards_prometheus_pd.py, _hicache.py).

The stack, all on loopback: a unified ``kvflow serve`` (at most 2 running requests, so
requests queue) behind a cache_aware ``kvflow router`` with a small admission limit (so
some requests are refused) and a round_robin one that also lists a dead worker (so retries
and breaker transitions happen), and the autoscaler's collectors, fed by its real
collector and decision against the server, served as the operator serves them. Prometheus scrapes all of it every second with
the labels a PodMonitor attaches. After load through the router, each panel's PromQL, with
the dashboard variables filled in, must give at least one finite value: no dead panel, no
misspelt metric or label.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).parents[1] / "router"))

from prometheus_client import start_http_server
from prometheus_stack import (
    DASHBOARDS,
    NAMESPACE,
    PROMETHEUS,
    Prometheus,
    dead_panels,
    empty_variables,
    fill,
    panel_queries,
    patient_server_start,
)
from router_process import RouterProcess
from server_process import ServerProcess, free_port

from kvflow.operator.autoscale import ScalePolicy, ScaleState, decide, role_signals
from kvflow.operator.autoscale.collector import (
    Collector,
    PodTarget,
    PrometheusSource,
    ScrapeSource,
)
from kvflow.operator.autoscale.metrics import AutoscalerMetrics

CHECKED_HERE = ("kvflow-overview", "kvflow-kv-cache", "kvflow-router", "kvflow-autoscaler")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus package is not installed (scripts/setup.sh)"
)


class Stack(NamedTuple):
    prometheus: Prometheus
    loaded_at: float  # wall time after the load, when queries are evaluated
    server_url: str


def stream(url: str, prompt: str, tokens: int) -> int:
    """A streamed completion; returns the HTTP status (429s are expected here)."""
    body = {"model": "x", "prompt": prompt, "max_tokens": tokens, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for _ in response.iter_lines():
            pass
        return response.status_code


def autoscaler_exporter(server: ServerProcess, stop: threading.Event) -> int:
    """The autoscaler's collectors on a loopback port, updated every second from its
    collector and decision against ``server``; returns the port."""
    metrics = AutoscalerMetrics()
    port = free_port()
    start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    policy = ScalePolicy(
        "unified",
        max_replicas=3,
        queue_per_replica=1,
        kv_usage=0.5,
        ttft_s=1.0,
        itl_s=0.2,
        running_per_replica=1.8,
        scale_up_window_s=2,
    )

    def run() -> None:
        source = ScrapeSource(timeout=5)
        collector = Collector(source, window_s=60)
        pod = PodTarget("serve-unified", server.url)
        state, replicas = ScaleState(), 1
        while not stop.wait(1.0):
            now = time.monotonic()
            windows = collector.collect(NAMESPACE, [pod], now)
            sig = role_signals([pod.name], windows, now, stale_seconds=10)
            decision, state = decide(policy, sig, replicas, state, now)
            metrics.observe((NAMESPACE, "demo", "unified"), policy, sig, replicas, decision)
            replicas = decision.replicas
        source.close()

    threading.Thread(target=run, daemon=True).start()
    return port


@pytest.fixture(scope="module")
def stack(model_path, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("dashboards")
    with patient_server_start():
        server = ServerProcess(
            "--max-total-tokens", "6000", "--context-length", "2048",
            "--max-running-requests", "2",
            log=logs / "serve.log",
        )  # fmt: skip
    router = faulty = prometheus = None
    stop = threading.Event()
    try:
        router = RouterProcess(
            "--policy", "cache_aware",
            "--worker-urls", server.url,
            "--max-concurrent", "6",
            "--max-queued", "2",
            log=logs / "router.log",
        )  # fmt: skip
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        # round robin hands the dead worker its turn (its health check fails only once in
        # the first minute): a connect error, a retry on the server, the breaker opening
        faulty = RouterProcess(
            "--policy", "round_robin",
            "--worker-urls", f"{dead},{server.url}",
            "--health-interval-s", "60",
            "--breaker-failure-threshold", "1",
            "--retry-initial-backoff-s", "0.01",
            log=logs / "router-faulty.log",
        )  # fmt: skip
        exporter_port = autoscaler_exporter(server, stop)
        prometheus = Prometheus(
            {
                "runtime": [(server.url.removeprefix("http://"), "serve-unified")],
                "router": [
                    (router.url.removeprefix("http://"), "router"),
                    (faulty.url.removeprefix("http://"), "router-faulty"),
                ],
                "operator": [(f"127.0.0.1:{exporter_port}", "operator")],
            },
            logs,
        )
        prometheus.wait_scraped(jobs=3)
        prefix = "The quick brown fox jumps over the lazy dog. " * 6
        with ThreadPoolExecutor(12) as pool:
            statuses = list(
                pool.map(lambda i: stream(router.url, f"{prefix} story {i % 3}:", 16), range(24))
            )
        assert statuses.count(200) >= 6 and 429 in statuses, statuses
        faulty_statuses = [stream(faulty.url, f"{prefix} retry {i}:", 4) for i in range(2)]
        assert faulty_statuses == [200, 200]  # the retry hides the dead worker
        time.sleep(4)  # a few scrapes after the last request
        yield Stack(prometheus, time.time(), server.url)
    finally:
        stop.set()
        if prometheus is not None:
            prometheus.stop()
        for r in (router, faulty):
            if r is not None:
                r.stop()
        server.stop()


def test_dashboards_exist_and_each_is_checked_by_a_stack() -> None:
    shipped = {p.stem for p in DASHBOARDS.glob("*.json")}
    assert shipped == {*CHECKED_HERE, "kvflow-pd", "kvflow-hicache"}
    assert sum(len(panel_queries(d)) for d in shipped) >= 40


@pytest.mark.parametrize("dashboard", CHECKED_HERE)
def test_every_panel_query_returns_data(stack: Stack, dashboard: str) -> None:
    dead, checked = dead_panels(stack.prometheus, dashboard, stack.loaded_at)
    assert not dead, "\n".join(dead)
    assert checked >= 4


@pytest.mark.parametrize("dashboard", CHECKED_HERE)
def test_variable_queries_return_values(stack: Stack, dashboard: str) -> None:
    assert not empty_variables(stack.prometheus, dashboard)


def test_a_misspelt_metric_would_be_caught(stack: Stack) -> None:
    expr = fill('sum by (pod) (sglang:num_queue_request{namespace=~"$namespace"})')
    answer = stack.prometheus.query(expr, stack.loaded_at)
    assert answer["status"] == "success" and answer["data"]["result"] == []


def test_the_autoscaler_reads_the_same_signals_through_prometheus(stack: Stack) -> None:
    """``--autoscaler-prometheus-url``: the pod's series, selected by namespace and pod."""
    source = PrometheusSource(stack.prometheus.url)
    pods = [PodTarget("serve-unified", "unused"), PodTarget("no-such-pod", "unused")]
    (sample,) = source.read(NAMESPACE, pods, now=0.0)
    direct = ScrapeSource().read(NAMESPACE, [PodTarget("serve-unified", stack.server_url)], 0.0)
    assert sample.pod == "serve-unified"
    assert sample.queue == direct[0].queue == 0 and sample.running == 0  # idle after the load
    assert sample.ttft is not None and direct[0].ttft is not None
    assert sample.ttft.bounds == direct[0].ttft.bounds
    assert sample.ttft.total == direct[0].ttft.total > 0
    assert sample.cached_kv == pytest.approx(direct[0].cached_kv)
    assert source.read("other-namespace", pods, now=0.0) == []
