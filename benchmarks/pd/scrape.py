"""A server's Prometheus counters, summed over labels, and the differences between scrapes."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["TRANSFER_SAMPLES", "scrape", "since"]

# The prefill's KV-write samples the benchmark reads (docs/runtime.md, "Metrics").
TRANSFER_SAMPLES = (
    "kvflow:kv_transfer_bytes_total",
    "kvflow:kv_transfer_seconds_sum",
    "kvflow:kv_transfer_seconds_count",
    "sglang:num_transfer_failed_reqs_total",
)


def scrape(base_url: str, names: tuple[str, ...] = TRANSFER_SAMPLES) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10, trust_env=False).text
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}
