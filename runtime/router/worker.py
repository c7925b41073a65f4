"""One model server as the router tracks it: health, breaker and load."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from yarl import URL

from kvflow.runtime.router.breaker import CircuitBreaker
from kvflow.runtime.router.discovery import WorkerSpec
from kvflow.runtime.router.metrics import WorkerMetrics

__all__ = ["Worker"]


class Worker:
    """Mutable state of one worker, owned by the :class:`WorkerRegistry`, event loop only.

    ``load`` is the router's own in-flight count, refined by what the worker last reported
    in ``/metrics`` (running + queued requests): the part of the reported load that the
    router did not send itself (other routers, direct clients) is added to the count.
    """

    def __init__(self, spec: WorkerSpec, breaker: CircuitBreaker) -> None:
        self.spec = spec
        self.breaker = breaker
        self.healthy = True  # optimistic: discovery only hands over Ready pods
        self.passed_checks = 0
        self.failed_checks = 0
        self.last_error = ""
        self.in_flight = 0
        self.reported_load: int | None = None
        self._external_load = 0
        self.metrics: WorkerMetrics | None = None  # prometheus children, set by the registry
        # LoRA adapters loaded there, name -> path, as its /v1/models last said (None:
        # not asked; only workers whose adapters the router manages are asked)
        self.adapters: dict[str, str] | None = None
        self._targets: dict[str, URL] = {}

    def begin(self) -> None:
        """A request to this worker went out."""
        self.in_flight += 1
        if self.metrics is not None:
            self.metrics.in_flight.inc()

    def end(self) -> None:
        """That request is over (answered, failed or abandoned)."""
        self.in_flight -= 1
        if self.metrics is not None:
            self.metrics.in_flight.dec()

    def observe_ttfb(self, seconds: float) -> None:
        """Request sent to the first body byte (``kvflow_router_upstream_ttfb_seconds``)."""
        if self.metrics is not None:
            self.metrics.ttfb.observe(seconds)

    def observe_latency(self, seconds: float) -> None:
        """Request sent to the last byte (``kvflow_router_upstream_latency_seconds``)."""
        if self.metrics is not None:
            self.metrics.latency.observe(seconds)

    def target(self, path: str) -> URL:
        """``url + path`` as a parsed URL, built once per path (the client skips parsing)."""
        url = self._targets.get(path)
        if url is None:
            if len(self._targets) >= 64:  # paths come from the router's fixed routes
                self._targets.clear()
            url = self._targets[path] = URL(self.spec.url + path)
        return url

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def host(self) -> str:
        """The worker's host name or IP (what PD's ``bootstrap_host`` carries)."""
        return urlsplit(self.spec.url).hostname or ""

    @property
    def desired_adapters(self) -> dict[str, str] | None:
        """The adapters the router keeps loaded here (name -> path); None: not managed."""
        wanted = self.spec.lora_adapters
        return None if wanted is None else dict(wanted)

    def has_adapters(self, names: frozenset[str]) -> bool:
        """Whether every adapter of ``names`` is loaded here (as far as the router knows)."""
        return self.adapters is not None and names <= self.adapters.keys()

    @property
    def load(self) -> int:
        return self.in_flight + self._external_load

    @property
    def available(self) -> bool:
        """Healthy and its breaker would let a request through (without taking a probe)."""
        return self.healthy and self.breaker.peek()

    def report_load(self, running_and_queued: int) -> None:
        """Take the worker's own figure, scraped while ``in_flight`` was current."""
        self.reported_load = running_and_queued
        self._external_load = max(0, running_and_queued - self.in_flight)

    def describe(self) -> dict[str, Any]:
        """The ``GET /workers`` entry."""
        return {
            "url": self.url,
            "role": self.role,
            "bootstrap_port": self.spec.bootstrap_port,
            "healthy": self.healthy,
            "breaker": self.breaker.state.value,
            "consecutive_failures": self.breaker.consecutive_failures,
            "in_flight": self.in_flight,
            "reported_load": self.reported_load,
            "load": self.load,
            "last_error": self.last_error,
            "lora_adapters": None if self.adapters is None else sorted(self.adapters),
        }
