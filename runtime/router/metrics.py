"""The router's Prometheus collectors, in their own registry, named ``kvflow_router_*``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["METRIC_NAMES", "RouterMetrics", "WorkerMetrics"]

_LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_LATENCY_BUCKETS += (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# name (as exported) -> help; docs/router.md lists every one (tests/router checks it).
METRIC_NAMES = {
    "kvflow_router_requests_total": "requests answered, by route, worker and status code",
    "kvflow_router_in_flight": "requests the router has open to each worker",
    "kvflow_router_retries_total": "retries made on another worker, by route",
    "kvflow_router_rejected_total": "requests refused by the router itself, by reason",
    "kvflow_router_breaker_state": "circuit breaker per worker: 0 closed, 1 half-open, 2 open",
    "kvflow_router_breaker_transitions_total": "breaker state changes, by worker and new state",
    "kvflow_router_worker_healthy": "1 when the worker passes its active health checks",
    "kvflow_router_worker_load": "load the router uses per worker (own in-flight + reported)",
    "kvflow_router_queue_length": "requests waiting for an admission slot",
    "kvflow_router_queue_wait_seconds": "histogram: time spent waiting for an admission slot",
    "kvflow_router_cache_match_ratio": "histogram: cache_aware prefix match / prompt length",
    "kvflow_router_upstream_ttfb_seconds": "histogram: request sent to first body byte, by worker",
    "kvflow_router_upstream_latency_seconds": "histogram: request sent to last byte, by worker",
    "kvflow_router_lora_requests_total": "requests naming a LoRA adapter, by adapter",
    "kvflow_router_lora_adapter_loaded": "1 for each LoRA adapter a worker has loaded, by worker "
    "and adapter",
    "kvflow_router_lora_operations_total": "LoRA adapter loads and unloads the router asked of "
    "workers, by adapter, operation and result",
}


@dataclass(frozen=True)
class WorkerMetrics:
    """One worker's labelled children, looked up once (``labels()`` costs microseconds)."""

    in_flight: Any
    ttfb: Any
    latency: Any


class RouterMetrics:
    """Every collector the router updates; one instance per process (or per test app).

    Hot-path updates go through cached children: :meth:`for_worker` and :meth:`count`.
    """

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()

        def text(name: str) -> str:
            return METRIC_NAMES[name]

        def counter(name: str, labels: list[str]) -> Counter:
            # prometheus_client appends "_total" itself
            return Counter(name.removesuffix("_total"), text(name), labels, registry=r)

        def histogram(name: str, labels: list[str], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text(name), labels, buckets=buckets, registry=r)

        self.requests = counter("kvflow_router_requests_total", ["route", "worker", "status"])
        self.in_flight = Gauge(
            "kvflow_router_in_flight", text("kvflow_router_in_flight"), ["worker"], registry=r
        )
        self.retries = counter("kvflow_router_retries_total", ["route"])
        self.rejected = counter("kvflow_router_rejected_total", ["reason"])
        self.breaker_state = Gauge(
            "kvflow_router_breaker_state",
            text("kvflow_router_breaker_state"),
            ["worker"],
            registry=r,
        )
        self.breaker_transitions = counter(
            "kvflow_router_breaker_transitions_total", ["worker", "state"]
        )
        self.healthy = Gauge(
            "kvflow_router_worker_healthy",
            text("kvflow_router_worker_healthy"),
            ["worker"],
            registry=r,
        )
        self.load = Gauge(
            "kvflow_router_worker_load", text("kvflow_router_worker_load"), ["worker"], registry=r
        )
        self.queue_length = Gauge(
            "kvflow_router_queue_length", text("kvflow_router_queue_length"), registry=r
        )
        self.queue_wait = histogram("kvflow_router_queue_wait_seconds", [], _LATENCY_BUCKETS)
        self.match_ratio = histogram("kvflow_router_cache_match_ratio", [], _RATIO_BUCKETS)
        self.ttfb = histogram("kvflow_router_upstream_ttfb_seconds", ["worker"], _LATENCY_BUCKETS)
        self.latency = histogram(
            "kvflow_router_upstream_latency_seconds", ["worker"], _LATENCY_BUCKETS
        )
        self.lora_requests = counter("kvflow_router_lora_requests_total", ["adapter"])
        self.lora_loaded = Gauge(
            "kvflow_router_lora_adapter_loaded",
            text("kvflow_router_lora_adapter_loaded"),
            ["worker", "adapter"],
            registry=r,
        )
        self.lora_operations = counter(
            "kvflow_router_lora_operations_total", ["adapter", "operation", "result"]
        )
        self._request_counts: dict[tuple[str, str, int], Any] = {}

    def for_worker(self, url: str) -> WorkerMetrics:
        """``url``'s children of the per-worker series the forwarding path updates."""
        return WorkerMetrics(
            self.in_flight.labels(url), self.ttfb.labels(url), self.latency.labels(url)
        )

    def count(self, route: str, worker: str, status: int) -> None:
        """One answered request (``kvflow_router_requests_total``)."""
        key = (route, worker, status)
        child = self._request_counts.get(key)
        if child is None:
            child = self._request_counts[key] = self.requests.labels(route, worker, str(status))
        child.inc()

    def forget_worker(self, url: str) -> None:
        """Drop a removed worker's per-worker gauges (counters and histograms stay)."""
        for gauge in (self.in_flight, self.breaker_state, self.healthy, self.load):
            with contextlib.suppress(KeyError):
                gauge.remove(url)
