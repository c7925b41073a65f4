"""Prometheus metrics under SGLang's names (``sglang:`` prefix), so existing dashboards and
the Gateway API Inference Extension's endpoint picker can read them."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from kvflow.runtime.server.hicache_metrics import HiCacheMetrics
from kvflow.runtime.wire.messages import SchedulerStats

__all__ = ["METRIC_NAMES", "REJECT_REASONS", "RuntimeMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_THROUGHPUT_WINDOW_S = 5.0
REJECT_REASONS = ("queue_full", "draining", "unhealthy")
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# name -> help; the docs list is generated from this table.
METRIC_NAMES = {
    "sglang:num_running_reqs": "requests in the running batch",
    "sglang:num_queue_reqs": "requests waiting to be scheduled",
    "sglang:num_grammar_queue_reqs": "requests waiting for their grammar to compile (structured output)",
    "sglang:token_usage": "fraction of KV cache slots held by requests (evictable prefix cache excluded, as SGLang)",
    "kvflow:prefix_cache_usage": "fraction of KV cache slots held by the prefix cache (evictable or locked)",
    "sglang:gen_throughput": "generated tokens per second over the last 5 s",
    "sglang:cache_hit_rate": "cached prompt tokens / prompt tokens, since start",
    "sglang:prompt_tokens_total": "prompt tokens of finished requests",
    "sglang:generation_tokens_total": "generated tokens of finished requests",
    "sglang:cached_tokens_total": "prompt tokens served from the prefix cache",
    "sglang:num_requests_total": "finished requests (any finish reason)",
    "sglang:num_aborted_requests_total": "requests aborted (client disconnect, abort API, errors)",
    "kvflow:num_rejected_requests_total": "requests refused with 503 before queueing, by reason (queue_full, draining, unhealthy)",
    "sglang:time_to_first_token_seconds": "histogram: arrival to first token (label is_streaming)",
    "sglang:inter_token_latency_seconds": "histogram: gap between streamed tokens",
    "sglang:e2e_request_latency_seconds": "histogram: arrival to finish",
    "sglang:cache_config_info": "KV cache layout: labels page_size and num_pages (value 1)",
    "sglang:num_prefill_inflight_queue_reqs": "prefill role: prefilled requests waiting for their decode's claim or being sent",
    "sglang:num_decode_prealloc_queue_reqs": "decode role: requests waiting for KV slots (pre-allocation queue)",
    "sglang:num_decode_transfer_queue_reqs": "decode role: requests whose slots are claimed, waiting for the prefill's KV (transfer queue)",
    "kvflow:kv_transfer_bytes_total": "prefill role: KV bytes written into decodes (completed writes)",
    "kvflow:kv_transfer_seconds": "prefill role: histogram: time of one request's KV write (transport only, not the wait for a claim)",
    "sglang:num_transfer_failed_reqs_total": "prefill role: KV writes that failed",
    "kvflow:kv_transfer_retries_total": "prefill role: KV transport calls repeated after a rejection or a transient failure (the write then landed or failed as a whole)",
    "sglang:kv_transfer_speed_gb_s": "prefill role: GB/s of the latest KV write",
    "sglang:kv_transfer_latency_ms": "prefill role: milliseconds of the latest KV write",
    "sglang:spec_accept_length": "speculative decoding: tokens kept per request per verify step (accepted drafts + 1), since start; 0 without speculation",
}
# Every metric carries model_name; these carry more labels.
_EXTRA_LABELS = {
    "kvflow:num_rejected_requests_total": ["reason"],
    "sglang:time_to_first_token_seconds": ["is_streaming"],
    "sglang:cache_config_info": ["page_size", "num_pages"],
}


class RuntimeMetrics:
    """The runtime's collectors in their own registry, labelled with the served model name.

    Counters exist with value 0 from the start (a scrape before the first request sees
    every series), and gauges follow the scheduler's published stats.
    """

    def __init__(self, model_name: str, page_size: int, num_pages: int) -> None:
        # Process-wide: no ``*_created`` series (a timestamp per counter/histogram that
        # SGLang does not export and dashboards would only have to filter out).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model = model_name
        r = self.registry

        def labels(name: str) -> list[str]:
            return ["model_name", *_EXTRA_LABELS.get(name, [])]

        def gauge(name: str) -> Gauge:
            return Gauge(name, METRIC_NAMES[name], labels(name), registry=r)

        def counter(name: str) -> Counter:
            # prometheus_client appends "_total" to counter names itself
            return Counter(
                name.removesuffix("_total"), METRIC_NAMES[name], labels(name), registry=r
            )

        def histogram(name: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, METRIC_NAMES[name], labels(name), buckets=buckets, registry=r)

        self.running = gauge("sglang:num_running_reqs")
        self.queued = gauge("sglang:num_queue_reqs")
        self.grammar_queued = gauge("sglang:num_grammar_queue_reqs")
        self.token_usage = gauge("sglang:token_usage")
        self.cache_usage = gauge("kvflow:prefix_cache_usage")
        self.gen_throughput = gauge("sglang:gen_throughput")
        self.hit_rate = gauge("sglang:cache_hit_rate")
        self.prompt_tokens = counter("sglang:prompt_tokens_total")
        self.generation_tokens = counter("sglang:generation_tokens_total")
        self.cached_tokens = counter("sglang:cached_tokens_total")
        self.requests = counter("sglang:num_requests_total")
        self.aborted = counter("sglang:num_aborted_requests_total")
        self.rejected = counter("kvflow:num_rejected_requests_total")
        self.ttft = histogram("sglang:time_to_first_token_seconds", _LATENCY_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds", _ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", _LATENCY_BUCKETS)
        self.prefill_inflight = gauge("sglang:num_prefill_inflight_queue_reqs")
        self.decode_prealloc = gauge("sglang:num_decode_prealloc_queue_reqs")
        self.decode_transfer = gauge("sglang:num_decode_transfer_queue_reqs")
        self.transfer_bytes = counter("kvflow:kv_transfer_bytes_total")
        self.transfer_seconds = histogram("kvflow:kv_transfer_seconds", _TRANSFER_BUCKETS)
        self.transfer_failed = counter("sglang:num_transfer_failed_reqs_total")
        self.transfer_retries = counter("kvflow:kv_transfer_retries_total")
        self.transfer_speed = gauge("sglang:kv_transfer_speed_gb_s")
        self.transfer_latency = gauge("sglang:kv_transfer_latency_ms")
        self.spec_accept_length = gauge("sglang:spec_accept_length")
        info = gauge("sglang:cache_config_info")
        info.labels(model_name, str(page_size), str(num_pages)).set(1)
        for metric in (
            self.running, self.queued, self.grammar_queued, self.token_usage, self.cache_usage,
            self.gen_throughput, self.hit_rate, self.prompt_tokens, self.generation_tokens,
            self.cached_tokens, self.requests, self.aborted, self.itl, self.e2e,
            self.prefill_inflight,
            self.decode_prealloc, self.decode_transfer, self.transfer_bytes,
            self.transfer_seconds, self.transfer_failed, self.transfer_retries,
            self.transfer_speed,
            self.transfer_latency, self.spec_accept_length,
        ):  # fmt: skip
            metric.labels(model_name)
        for reason in REJECT_REASONS:
            self.rejected.labels(model_name, reason)
        for streaming in ("true", "false"):
            self.ttft.labels(model_name, streaming)
        self.hicache: HiCacheMetrics | None = None  # created by the first stats with tiers
        self._prompt_total = 0
        self._cached_total = 0
        self._generated: deque[tuple[float, int]] = deque()  # (time, generated tokens so far)
        self._transfers_seen = 0  # kv_transfers already observed
        self._transfer_totals_seen = (0, 0, 0)  # (bytes, failures, retries) already counted

    def observe_stats(self, stats: SchedulerStats, now: float | None = None) -> None:
        if stats.hicache is not None:
            if self.hicache is None:
                self.hicache = HiCacheMetrics(self.registry, self.model)
            self.hicache.observe(stats.hicache)
        self.running.labels(self.model).set(stats.num_running_reqs)
        self.queued.labels(self.model).set(stats.num_queue_reqs)
        self.grammar_queued.labels(self.model).set(stats.num_grammar_queue_reqs)
        self.token_usage.labels(self.model).set(stats.token_usage)
        self.cache_usage.labels(self.model).set(stats.cached_tokens / max(stats.kv_total_tokens, 1))
        self.spec_accept_length.labels(self.model).set(stats.spec_accept_length)
        self._observe_disagg(stats)
        now = time.monotonic() if now is None else now
        window = self._generated
        window.append((now, stats.generated_tokens))
        while len(window) > 2 and now - window[1][0] >= _THROUGHPUT_WINDOW_S:
            window.popleft()
        (t0, n0), (t1, n1) = window[0], window[-1]
        self.gen_throughput.labels(self.model).set((n1 - n0) / (t1 - t0) if t1 > t0 else 0.0)

    def _observe_disagg(self, stats: SchedulerStats) -> None:
        """Queue gauges; the prefill's cumulative transfer totals become counter increments and
        its newest writes (those not seen in an earlier stats message) histogram samples."""
        m = self.model
        self.prefill_inflight.labels(m).set(stats.num_prefill_inflight_queue_reqs)
        self.decode_prealloc.labels(m).set(stats.num_decode_prealloc_queue_reqs)
        self.decode_transfer.labels(m).set(stats.num_decode_transfer_queue_reqs)
        seen_bytes, seen_failures, seen_retries = self._transfer_totals_seen
        self.transfer_bytes.labels(m).inc(max(stats.kv_transfer_bytes - seen_bytes, 0))
        self.transfer_failed.labels(m).inc(max(stats.kv_transfer_failures - seen_failures, 0))
        self.transfer_retries.labels(m).inc(max(stats.kv_transfer_retries - seen_retries, 0))
        self._transfer_totals_seen = (
            stats.kv_transfer_bytes,
            stats.kv_transfer_failures,
            stats.kv_transfer_retries,
        )
        new = stats.kv_transfers - self._transfers_seen
        self._transfers_seen = stats.kv_transfers
        recent = stats.recent_kv_transfers[-new:] if new > 0 else ()
        for seconds, _ in recent:
            self.transfer_seconds.labels(m).observe(seconds)
        if recent:
            seconds, nbytes = recent[-1]
            self.transfer_latency.labels(m).set(seconds * 1e3)
            self.transfer_speed.labels(m).set(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()

    def on_first_token(self, seconds: float, streaming: bool) -> None:
        self.ttft.labels(self.model, "true" if streaming else "false").observe(seconds)

    def on_token_gap(self, seconds: float, tokens: int = 1) -> None:
        for _ in range(tokens):
            self.itl.labels(self.model).observe(seconds / tokens)

    def on_finish(
        self, seconds: float, prompt: int, completion: int, cached: int, aborted: bool
    ) -> None:
        self.e2e.labels(self.model).observe(seconds)
        self.requests.labels(self.model).inc()
        self.prompt_tokens.labels(self.model).inc(prompt)
        self.generation_tokens.labels(self.model).inc(completion)
        self.cached_tokens.labels(self.model).inc(cached)
        if aborted:
            self.aborted.labels(self.model).inc()
        self._prompt_total += prompt
        self._cached_total += cached
        self.hit_rate.labels(self.model).set(self._cached_total / max(self._prompt_total, 1))
