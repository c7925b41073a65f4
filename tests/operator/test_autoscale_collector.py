"""The autoscaler's collector against a real ``kvflow serve`` under a little load: what it
reads from ``/metrics`` matches what the client saw, and the decision acts on it."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from server_process import ServerProcess

from kvflow.operator.autoscale import ScalePolicy, ScaleState, decide, role_signals
from kvflow.operator.autoscale.collector import Collector, PodTarget, ScrapeSource

MAX_RUNNING = 2


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-total-tokens",
        "6000",
        "--context-length",
        "2048",
        "--max-running-requests",
        str(MAX_RUNNING),
        log=tmp_path_factory.mktemp("autoscale") / "server.log",
    )
    yield proc
    proc.stop()


def stream(url: str, prompt: str, tokens: int) -> float:
    """One streamed completion; returns the client-side time to first token."""
    body = {"model": "x", "prompt": prompt, "max_tokens": tokens, "stream": True}
    body["ignore_eos"] = True
    start = time.monotonic()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and first is None:
                first = time.monotonic() - start
    assert first is not None
    return first


def test_collector_reads_load_and_windowed_latency(server: ServerProcess) -> None:
    pod = PodTarget("pod-a", server.url)
    source = ScrapeSource(timeout=5)
    collector = Collector(source, window_s=120)
    collector.collect("ns", [pod])  # the window's start: nothing served yet in it

    clients = 6  # three times the batch cap: some must queue
    busy: list[tuple[float, float]] = []  # (queue, running) seen while loaded
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            window = collector.collect("ns", [pod])
            busy.append((window["pod-a"][-1].queue, window["pod-a"][-1].running))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(clients) as pool:
            ttfts = list(pool.map(lambda i: stream(server.url, f"story {i}:", 24), range(clients)))
    finally:
        stop.set()
        watcher.join()
    window = collector.collect("ns", [pod])["pod-a"]
    source.close()

    assert max(q for q, _ in busy) >= 1, busy  # requests waited for a batch slot
    assert max(r for _, r in busy) == MAX_RUNNING
    sig = role_signals(["pod-a"], {"pod-a": window}, now=time.monotonic(), stale_seconds=10)
    assert sig.missing == () and sig.reporting == 1
    assert sig.itl_p90_s is not None and 0 < sig.itl_p90_s < 10
    # the p90 from bucket growth lies within the bucket holding the clients' own p90
    client_p90 = sorted(ttfts)[int(0.9 * (len(ttfts) - 1))]
    assert sig.ttft_p90_s is not None
    assert client_p90 / 2.5 <= sig.ttft_p90_s <= client_p90 * 2.5, (sig.ttft_p90_s, ttfts)
    assert window[-1].cached_kv >= 0 and window[-1].kv_usage >= 0


def test_decision_scales_out_on_real_queueing_then_holds_when_idle(server) -> None:
    pod = PodTarget("pod-a", server.url)
    source = ScrapeSource(timeout=5)
    collector = Collector(source, window_s=60)
    policy = ScalePolicy(
        "unified",
        max_replicas=4,
        queue_per_replica=1,
        scale_up_window_s=1.0,
        scale_down_window_s=30,
    )
    state = ScaleState()
    decisions = []
    stop = threading.Event()

    def load() -> None:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: stream(server.url, f"tale {i}:", 32), range(12)))
        stop.set()

    loader = threading.Thread(target=load)
    loader.start()
    while not stop.is_set():
        now = time.monotonic()
        windows = collector.collect("ns", [pod], now)
        sig = role_signals(["pod-a"], windows, now, stale_seconds=10)
        decision, state = decide(policy, sig, 1, state, now)
        decisions.append(decision)
        time.sleep(0.3)
    loader.join()
    source.close()
    ups = [d for d in decisions if d.direction == "up"]
    assert ups, [d.reason for d in decisions]
    assert "queue" in ups[0].reason and ups[0].replicas >= 2


def test_unreachable_pod_is_missing_and_holds(server) -> None:
    dead = PodTarget("pod-dead", "http://127.0.0.1:9")  # discard port: connection refused
    source = ScrapeSource(timeout=1)
    collector = Collector(source, window_s=60)
    now = time.monotonic()
    windows = collector.collect("ns", [PodTarget("pod-a", server.url), dead], now)
    source.close()
    assert windows["pod-dead"] == [] and len(windows["pod-a"]) == 1
    sig = role_signals(["pod-a", "pod-dead"], windows, now, stale_seconds=10)
    assert sig.missing == ("pod-dead",)
    decision, _ = decide(ScalePolicy("unified", kv_usage=0.5), sig, 2, ScaleState(), now)
    assert decision.direction == "hold" and "pod-dead" in decision.reason
