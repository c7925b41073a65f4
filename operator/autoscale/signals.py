"""What the autoscaler reads from one pod, and what it makes of a window of those reads.

A :class:`PodSample` is one scrape of one Ready pod's ``/metrics``: the gauges as they were,
and the two latency histograms as cumulative bucket counts. :func:`role_signals` turns the
samples of one role over a window into :class:`RoleSignals`, the input of the decision:

- gauges (queue, running, KV usage) are each pod's mean over its samples of the last
  ``gauge_window_s`` (Prometheus' ``avg_over_time``; 0 takes the newest sample alone): one
  scrape that catches a request counted on two pods at once (each pod's gauge lags its
  scheduler by up to a publishing interval) must not decide a size on its own;
- TTFT and ITL p90 come from the histograms' growth between the oldest and the newest
  sample in the window, summed over pods, interpolated inside a bucket as Prometheus'
  ``histogram_quantile`` does. A pod whose counts went down restarted: its newest counts
  alone are the growth since then (what ``rate()`` does on a counter reset);
- one sample is no window: latencies need two samples of a pod;
- a pod whose newest sample is older than the staleness limit, or that has none, or whose
  gauges are NaN, is *missing*; the decision holds the size while any pod is missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Buckets", "PodSample", "RoleSignals", "histogram_quantile", "role_signals"]


@dataclass(frozen=True)
class Buckets:
    """A cumulative histogram: ``counts[i]`` observations were ``<= bounds[i]``; the last
    bound is ``inf``."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, older: Buckets) -> Buckets:
        """Growth since ``older``; a reset (any count went down, or the layout changed)
        gives these counts alone."""
        reset = older.bounds != self.bounds or any(
            new < old for new, old in zip(self.counts, older.counts, strict=True)
        )
        if reset:
            return self
        counts = tuple(new - old for new, old in zip(self.counts, older.counts, strict=True))
        return Buckets(self.bounds, counts)


def _sum(buckets: Iterable[Buckets]) -> Buckets | None:
    """Bucket-wise sum of histograms with the same bounds (others are skipped)."""
    total: Buckets | None = None
    for b in buckets:
        if total is None:
            total = b
        elif b.bounds == total.bounds:
            total = Buckets(
                total.bounds, tuple(x + y for x, y in zip(total.counts, b.counts, strict=True))
            )
    return total


def histogram_quantile(q: float, buckets: Buckets | None) -> float | None:
    """The ``q`` quantile of a cumulative histogram, linear inside its bucket (Prometheus'
    rule); the highest finite bound when it falls in the ``+Inf`` bucket; None when the
    histogram holds no observations."""
    if buckets is None or buckets.total <= 0:
        return None
    rank = q * buckets.total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(buckets.bounds, buckets.counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            width = count - lower_count
            if width <= 0:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / width
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True)
class PodSample:
    """One scrape of one pod, taken at ``time`` (monotonic seconds).

    Gauges are SGLang's: ``queue`` (``sglang:num_queue_reqs``, plus the decode role's
    pre-allocation queue), ``running`` (``sglang:num_running_reqs``), ``kv_usage``
    (``sglang:token_usage``), ``cached_kv`` (``kvflow:prefix_cache_usage``: how much reusable
    prefix cache the pod holds, the scale-in preference). NaN marks a value the pod did not
    report.
    """

    pod: str
    time: float
    queue: float
    running: float
    kv_usage: float
    cached_kv: float
    ttft: Buckets | None
    itl: Buckets | None

    @property
    def valid(self) -> bool:
        return not any(math.isnan(v) for v in (self.queue, self.running, self.kv_usage))


@dataclass(frozen=True)
class RoleSignals:
    """One role's load at one moment, from its Ready pods' windows.

    Per-replica values divide by ``reporting`` (pods with a fresh, valid sample).
    ``missing`` names Ready pods without one; the decision holds while it is not empty.
    Latencies are None when no request finished a token in the window (no evidence).
    """

    ready: int
    reporting: int
    missing: tuple[str, ...]
    queue_per_replica: float
    running_per_replica: float
    kv_usage: float  # mean over reporting pods
    ttft_p90_s: float | None
    itl_p90_s: float | None
    cached_kv: Mapping[str, float]  # pod -> its newest cached_kv

    @property
    def idle(self) -> bool:
        return self.queue_per_replica == 0 and self.running_per_replica == 0


def role_signals(
    ready_pods: Sequence[str],
    windows: Mapping[str, Sequence[PodSample]],
    now: float,
    stale_seconds: float,
    quantile: float = 0.9,
    gauge_window_s: float = 0.0,
) -> RoleSignals:
    """Signals of one role from each Ready pod's samples (oldest first) within the window."""
    fresh: list[tuple[PodSample, PodSample]] = []  # (oldest, newest) per reporting pod
    missing: list[str] = []
    recent: list[list[PodSample]] = []  # per reporting pod: its samples in the gauge window
    for pod in ready_pods:
        samples = windows.get(pod) or ()
        newest = samples[-1] if samples else None
        if newest is None or now - newest.time > stale_seconds or not newest.valid:
            missing.append(pod)
        else:
            fresh.append((samples[0], newest))
            recent.append(
                [s for s in samples if s.valid and s.time >= now - gauge_window_s] or [newest]
            )
    n = len(fresh)
    newest_samples = [new for _, new in fresh]

    def per_replica(gauge: str) -> float:
        """Sum over pods of each pod's mean ``gauge`` over the gauge window, divided by n."""
        means = (sum(getattr(s, gauge) for s in pod) / len(pod) for pod in recent)
        return sum(means) / n if n else 0.0

    def growth(kind: str) -> Buckets | None:
        parts = []
        for old, new in fresh:
            new_b, old_b = getattr(new, kind), getattr(old, kind)
            if new_b is not None and old_b is not None and old is not new:
                parts.append(new_b.minus(old_b))
        return _sum(parts)

    return RoleSignals(
        ready=len(ready_pods),
        reporting=n,
        missing=tuple(missing),
        queue_per_replica=per_replica("queue"),
        running_per_replica=per_replica("running"),
        kv_usage=per_replica("kv_usage"),
        ttft_p90_s=histogram_quantile(quantile, growth("ttft")) if n else None,
        itl_p90_s=histogram_quantile(quantile, growth("itl")) if n else None,
        cached_kv={
            s.pod: (0.0 if math.isnan(s.cached_kv) else s.cached_kv) for s in newest_samples
        },
    )
