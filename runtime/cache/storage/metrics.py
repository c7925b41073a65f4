"""Counters of the storage I/O worker, ready for Prometheus (counters and histograms)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["LATENCY_BUCKETS_S", "IOCounters", "IOStats", "LatencySummary"]

# Upper bounds (seconds) of the latency histogram's buckets; the last bucket is +Inf.
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True)
class LatencySummary:
    """A histogram of store-call latencies: ``bucket_counts[i]`` counts calls at most
    ``LATENCY_BUCKETS_S[i]`` (not cumulative; the last entry is above every bound)."""

    count: int = 0
    sum_s: float = 0.0
    bucket_counts: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS_S) + 1)


@dataclass(frozen=True)
class IOStats:
    """A snapshot of :class:`IOCounters` (all monotonic).

    ``prefetch_outcomes`` and ``write_outcomes`` count completions by ``Outcome`` value
    (e.g. ``{"hit_full": 3, "partial": 1, "miss": 2, "timeout": 0}``).
    """

    read_bytes: int = 0
    write_bytes: int = 0
    read_pages: int = 0
    write_pages: int = 0
    read_latency: LatencySummary = LatencySummary()
    write_latency: LatencySummary = LatencySummary()
    prefetch_outcomes: dict[str, int] = field(default_factory=dict)
    write_outcomes: dict[str, int] = field(default_factory=dict)
    worker_errors: int = 0  # unexpected exceptions caught in the worker threads


class _Histogram:
    def __init__(self) -> None:
        self.count = 0
        self.sum_s = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1

    def summary(self) -> LatencySummary:
        return LatencySummary(self.count, self.sum_s, tuple(self.buckets))


class IOCounters:
    """Thread-safe counters the worker threads update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_latency = _Histogram()
        self._write_latency = _Histogram()
        self._prefetch: Counter[str] = Counter()
        self._writes: Counter[str] = Counter()
        self._read_bytes = self._write_bytes = self._read_pages = self._write_pages = 0
        self._worker_errors = 0

    def read(self, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._read_pages += pages
            self._read_bytes += nbytes
            self._read_latency.observe(seconds)

    def wrote(self, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._write_pages += pages
            self._write_bytes += nbytes
            self._write_latency.observe(seconds)

    def prefetch_done(self, outcome: str) -> None:
        with self._lock:
            self._prefetch[outcome] += 1

    def write_done(self, outcome: str) -> None:
        with self._lock:
            self._writes[outcome] += 1

    def worker_error(self) -> None:
        with self._lock:
            self._worker_errors += 1

    def snapshot(self) -> IOStats:
        with self._lock:
            return IOStats(
                read_bytes=self._read_bytes,
                write_bytes=self._write_bytes,
                read_pages=self._read_pages,
                write_pages=self._write_pages,
                read_latency=self._read_latency.summary(),
                write_latency=self._write_latency.summary(),
                prefetch_outcomes=dict(self._prefetch),
                write_outcomes=dict(self._writes),
                worker_errors=self._worker_errors,
            )
