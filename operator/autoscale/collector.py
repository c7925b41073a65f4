"""Collect :class:`PodSample` s of Ready pods into per-pod windows.

Two sources give the same samples:

- :class:`ScrapeSource` reads each pod's ``/metrics`` itself (``prometheus_client``'s
  parser), in parallel, each read bounded by a timeout;
- :class:`PrometheusSource` asks a Prometheus server (``--autoscaler-prometheus-url``) for
  the same series of the same pods, selected by the ``namespace`` and ``pod`` labels that a
  PodMonitor attaches.

A failed read adds nothing; the pod's newest sample ages, and once older than the
staleness limit the decision holds (``signals.role_signals``).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import time
import urllib.parse
import urllib.request
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from kvflow import contract

from .signals import Buckets, PodSample

__all__ = [
    "Collector",
    "PodTarget",
    "PrometheusSource",
    "ScrapeSource",
    "Source",
    "sample_from_series",
    "sample_from_text",
]

log = logging.getLogger(__name__)

QUEUE = ("sglang:num_queue_reqs", "sglang:num_decode_prealloc_queue_reqs")
RUNNING = "sglang:num_running_reqs"
KV_USAGE = "sglang:token_usage"
CACHED_KV = "kvflow:prefix_cache_usage"
TTFT = "sglang:time_to_first_token_seconds"
ITL = "sglang:inter_token_latency_seconds"
GAUGES = (*QUEUE, RUNNING, KV_USAGE, CACHED_KV)
HISTOGRAMS = (TTFT, ITL)


@dataclass(frozen=True)
class PodTarget:
    """A Ready pod to read: its name and the base URL of its API port."""

    name: str
    url: str

    @classmethod
    def for_pod_ip(cls, name: str, ip: str, port: int = contract.DEFAULT_API_PORT) -> PodTarget:
        host = f"[{ip}]" if ":" in ip else ip
        return cls(name, f"http://{host}:{port}")


# One series: (name, labels) -> value; what both sources reduce to.
Series = Iterable[tuple[str, Mapping[str, str], float]]


def sample_from_series(pod: str, now: float, series: Series) -> PodSample:
    """A sample from raw series: gauges summed over label sets, histogram buckets summed
    per ``le``. Gauges absent or NaN come out NaN."""
    gauges: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for name, labels, value in series:
        if name in GAUGES:
            gauges[name] = gauges.get(name, 0.0) + value
        elif name.endswith("_bucket") and name.removesuffix("_bucket") in HISTOGRAMS:
            buckets[name.removesuffix("_bucket")][float(labels["le"])] += value

    def histogram(name: str) -> Buckets | None:
        per_le = buckets.get(name)
        if not per_le or not math.isinf(max(per_le)):
            return None
        bounds = tuple(sorted(per_le))
        return Buckets(bounds, tuple(per_le[b] for b in bounds))

    nan = math.nan
    queue = sum(gauges.get(q, 0.0) for q in QUEUE) if QUEUE[0] in gauges else nan
    return PodSample(
        pod=pod,
        time=now,
        queue=queue,
        running=gauges.get(RUNNING, nan),
        kv_usage=gauges.get(KV_USAGE, nan),
        cached_kv=gauges.get(CACHED_KV, nan),
        ttft=histogram(TTFT),
        itl=histogram(ITL),
    )


def sample_from_text(pod: str, now: float, text: str) -> PodSample:
    """A sample from a pod's Prometheus text exposition."""
    series = (
        (s.name, s.labels, float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )
    return sample_from_series(pod, now, series)


class Source(Protocol):
    """Reads the current samples of some pods; pods that could not be read are left out."""

    def read(self, namespace: str, pods: Sequence[PodTarget], now: float) -> list[PodSample]: ...


# No proxy from the environment: pod IPs are reached directly.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, timeout: float) -> str:
    """Body of a GET (stdlib only: the operator image carries no HTTP client library);
    HTTP errors raise (``HTTPError`` is an ``OSError``)."""
    with _OPENER.open(url, timeout=timeout) as response:
        return response.read().decode()


class ScrapeSource:
    """GET ``<pod url>/metrics`` of every pod in parallel."""

    def __init__(self, timeout: float = 2.0, parallel: int = 8) -> None:
        self._timeout = timeout
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="kvflow-scrape")

    def _one(self, pod: PodTarget, now: float) -> PodSample | None:
        try:
            return sample_from_text(
                pod.name, now, _get(pod.url + contract.METRICS_PATH, self._timeout)
            )
        except (
            OSError,
            ValueError,
            http.client.HTTPException,
        ) as exc:  # URLError, timeouts: OSError
            log.info("autoscaler: cannot read %s: %s", pod.url, exc)
            return None

    def read(self, namespace: str, pods: Sequence[PodTarget], now: float) -> list[PodSample]:
        results = self._pool.map(lambda p: self._one(p, now), pods)
        return [s for s in results if s is not None]

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _promql_regex(literal: str) -> str:
    """``literal`` as an RE2 pattern inside a double-quoted PromQL string, where each of
    the regex's backslashes must itself be escaped."""
    return re.escape(literal).replace("\\", "\\\\")


class PrometheusSource:
    """One instant query per call to a Prometheus server's HTTP API for the pods' series."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self._url = url.rstrip("/")
        self._timeout = timeout

    def query(self, namespace: str, pods: Sequence[PodTarget]) -> str:
        names = [*GAUGES, *(f"{h}_bucket" for h in HISTOGRAMS)]
        pod_re = "|".join(_promql_regex(p.name) for p in pods)
        names_re = "|".join(_promql_regex(n) for n in names)
        return f'{{__name__=~"{names_re}",namespace="{namespace}",pod=~"{pod_re}"}}'

    def read(self, namespace: str, pods: Sequence[PodTarget], now: float) -> list[PodSample]:
        if not pods:
            return []
        params = urllib.parse.urlencode({"query": self.query(namespace, pods)})
        try:
            body = _get(f"{self._url}/api/v1/query?{params}", self._timeout)
            result = json.loads(body)["data"]["result"]
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            log.warning("autoscaler: Prometheus query failed: %s", exc)
            return []
        by_pod: dict[str, list[tuple[str, Mapping[str, str], float]]] = defaultdict(list)
        for item in result:
            labels = item["metric"]
            by_pod[labels.get("pod", "")].append(
                (labels["__name__"], labels, float(item["value"][1]))
            )
        return [sample_from_series(p.name, now, by_pod[p.name]) for p in pods if p.name in by_pod]

    def close(self) -> None:
        pass


class Collector:
    """Per-pod windows of samples (``window_s`` long) for each role being watched."""

    def __init__(self, source: Source, window_s: float = 60.0) -> None:
        self._source = source
        self._window_s = window_s
        self._windows: dict[tuple[str, str], deque[PodSample]] = {}

    def collect(
        self, namespace: str, pods: Sequence[PodTarget], now: float | None = None
    ) -> dict[str, list[PodSample]]:
        """Read ``pods`` once and return each one's window (oldest first); windows of
        deleted pods are dropped by :meth:`drop`."""
        now = time.monotonic() if now is None else now
        for sample in self._source.read(namespace, pods, now):
            window = self._windows.setdefault((namespace, sample.pod), deque())
            window.append(sample)
        result = {}
        for pod in pods:
            window = self._windows.get((namespace, pod.name), deque())
            while window and now - window[0].time > self._window_s:
                window.popleft()
            result[pod.name] = list(window)
        return result

    def drop(self, namespace: str, pods: Iterable[str]) -> None:
        """Drop the windows of ``namespace``'s ``pods`` (deleted pods)."""
        for pod in pods:
            self._windows.pop((namespace, pod), None)
