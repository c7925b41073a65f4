"""HiCache's Prometheus series: SGLang's names where SGLang has one, ``kvflow:`` otherwise.

Exported only by a server running the host tier (``--hicache-host-memory-gb``); every
series exists from start-up. The scheduler publishes cumulative totals
(:class:`~kvflow.runtime.wire.hicache.HiCacheStats`); counters advance by their deltas.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvflow.runtime.wire.hicache import HiCacheStats

__all__ = ["HICACHE_METRIC_NAMES", "HiCacheMetrics"]

TIERS = ("device", "host", "storage")
STORAGE_OPS = ("read", "write")
PREFETCH_OUTCOMES = ("full", "partial", "miss", "timeout")

HICACHE_METRIC_NAMES = {
    "sglang:hicache_host_used_tokens": "HiCache: tokens held in the host KV pool",
    "sglang:hicache_host_total_tokens": "HiCache: capacity of the host KV pool in tokens",
    "kvflow:hicache_hit_tokens_total": "HiCache: prompt tokens found cached at admission, by tier (device, host, storage)",
    "sglang:load_back_tokens_total": "HiCache: tokens copied from host back to the device for a request",
    "sglang:prefetched_tokens_total": "HiCache: prompt tokens prefetched from the storage tier",
    "sglang:backuped_tokens_total": "HiCache: tokens copied from the device to the host tier",
    "kvflow:hicache_dropped_tokens_total": "HiCache: device evictions that found no room on host (KV lost)",
    "kvflow:hicache_storage_bytes_total": "HiCache storage tier: bytes read / written (label op)",
    "kvflow:hicache_storage_seconds_total": "HiCache storage tier: seconds spent in store calls (label op)",
    "kvflow:hicache_storage_ops_total": "HiCache storage tier: store calls (label op)",
    "kvflow:hicache_storage_errors_total": "HiCache storage tier: failed store calls (unreachable store, I/O errors, corrupt pages)",
    "kvflow:hicache_prefetch_total": "HiCache storage tier: prefetches by outcome (full, partial, miss, timeout)",
}
_LABELS = {
    "kvflow:hicache_hit_tokens_total": ["tier"],
    "kvflow:hicache_storage_bytes_total": ["op"],
    "kvflow:hicache_storage_seconds_total": ["op"],
    "kvflow:hicache_storage_ops_total": ["op"],
    "kvflow:hicache_prefetch_total": ["outcome"],
}


class HiCacheMetrics:
    """HiCache collectors in the runtime's registry, labelled with the model name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model = model_name
        self._seen: dict[tuple[str, tuple[str, ...]], float] = {}
        self._gauges: dict[str, Gauge] = {}
        self._counters: dict[str, Counter] = {}
        for name, text in HICACHE_METRIC_NAMES.items():
            labels = ["model_name", *_LABELS.get(name, [])]
            if name.endswith("_total"):
                self._counters[name] = Counter(
                    name.removesuffix("_total"), text, labels, registry=registry
                )
            else:
                self._gauges[name] = Gauge(name, text, labels, registry=registry)
        self.observe(HiCacheStats())  # every series from start-up

    def _count(self, name: str, total: float, *labels: str) -> None:
        key = (name, labels)
        delta = total - self._seen.get(key, 0.0)
        self._seen[key] = total
        self._counters[name].labels(self.model, *labels).inc(max(delta, 0.0))

    def observe(self, s: HiCacheStats) -> None:
        self._gauges["sglang:hicache_host_used_tokens"].labels(self.model).set(s.host_used_tokens)
        self._gauges["sglang:hicache_host_total_tokens"].labels(self.model).set(s.host_total_tokens)
        hits = {
            "device": s.device_hit_tokens,
            "host": s.host_hit_tokens,
            "storage": s.storage_hit_tokens,
        }
        for tier in TIERS:
            self._count("kvflow:hicache_hit_tokens_total", hits[tier], tier)
        self._count("sglang:load_back_tokens_total", s.host_hit_tokens + s.storage_hit_tokens)
        self._count("sglang:prefetched_tokens_total", s.storage_hit_tokens)
        self._count("sglang:backuped_tokens_total", s.backed_up_tokens)
        self._count("kvflow:hicache_dropped_tokens_total", s.dropped_tokens)
        io = {
            "read": (s.storage_read_bytes, s.storage_read_seconds, s.storage_reads),
            "write": (s.storage_write_bytes, s.storage_write_seconds, s.storage_writes),
        }
        for op in STORAGE_OPS:
            nbytes, seconds, count = io[op]
            self._count("kvflow:hicache_storage_bytes_total", nbytes, op)
            self._count("kvflow:hicache_storage_seconds_total", seconds, op)
            self._count("kvflow:hicache_storage_ops_total", count, op)
        self._count("kvflow:hicache_storage_errors_total", s.storage_errors)
        outcomes = {
            "full": s.prefetch_full,
            "partial": s.prefetch_partial,
            "miss": s.prefetch_miss,
            "timeout": s.prefetch_timeout,
        }
        for outcome in PREFETCH_OUTCOMES:
            self._count("kvflow:hicache_prefetch_total", outcomes[outcome], outcome)
