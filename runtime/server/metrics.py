"""Prometheus metrics under SGLang's names (``sglang:`` prefix), so existing dashboards and
the Gateway API Inference Extension's endpoint picker can read them."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvflow.runtime.wire.messages import SchedulerStats

__all__ = ["METRIC_NAMES", "REJECT_REASONS", "RuntimeMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_THROUGHPUT_WINDOW_S = 5.0
REJECT_REASONS = ("queue_full", "draining", "unhealthy")
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# name -> help; the docs list is generated from this table.
METRIC_NAMES = {
    "sglang:num_running_reqs": "requests in the running batch",
    "sglang:num_queue_reqs": "requests waiting to be scheduled",
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
        info = gauge("sglang:cache_config_info")
        info.labels(model_name, str(page_size), str(num_pages)).set(1)
        for metric in (
            self.running, self.queued, self.token_usage, self.cache_usage, self.gen_throughput,
            self.hit_rate, self.prompt_tokens, self.generation_tokens, self.cached_tokens,
            self.requests, self.aborted, self.itl, self.e2e,
        ):  # fmt: skip
            metric.labels(model_name)
        for reason in REJECT_REASONS:
            self.rejected.labels(model_name, reason)
        for streaming in ("true", "false"):
            self.ttft.labels(model_name, streaming)
        self._prompt_total = 0
        self._cached_total = 0
        self._generated: deque[tuple[float, int]] = deque()  # (time, generated tokens so far)

    def observe_stats(self, stats: SchedulerStats, now: float | None = None) -> None:
        self.running.labels(self.model).set(stats.num_running_reqs)
        self.queued.labels(self.model).set(stats.num_queue_reqs)
        self.token_usage.labels(self.model).set(stats.token_usage)
        self.cache_usage.labels(self.model).set(stats.cached_tokens / max(stats.kv_total_tokens, 1))
        now = time.monotonic() if now is None else now
        window = self._generated
        window.append((now, stats.generated_tokens))
        while len(window) > 2 and now - window[1][0] >= _THROUGHPUT_WINDOW_S:
            window.popleft()
        (t0, n0), (t1, n1) = window[0], window[-1]
        self.gen_throughput.labels(self.model).set((n1 - n0) / (t1 - t0) if t1 > t0 else 0.0)

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
