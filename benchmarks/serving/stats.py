"""From a :class:`RunRecord` to the numbers the results table shows.

Definitions (the same for every server):

- output tokens/s: output tokens of successful requests / wall time of the run (first send
  to last finish); output tokens come from the server's ``usage`` where it reports one.
- TTFT: send to the first stream event that carries text.
- ITL: gap between consecutive text events of one request, pooled over all requests (a
  server that packs several tokens into one event shows fewer, longer gaps).
- TPOT: per request, (latency - TTFT) / (output tokens - 1); robust to such packing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .client import RunRecord

__all__ = ["Summary", "percentile", "summarize"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """One run, reduced. Times in seconds except ``*_ms`` fields."""

    concurrency: int
    requests: int
    succeeded: int
    timed_out: bool
    duration_s: float
    output_tokens: int
    output_tok_s: float
    request_s: float
    mean_prompt_tokens: float
    min_output_tokens: int
    max_output_tokens: int
    text_events: int
    cached_tokens: int | None
    ttft_median_s: float
    ttft_p99_s: float
    itl_median_ms: float
    itl_p99_ms: float
    tpot_median_ms: float
    first_error: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(record: RunRecord, requests: int) -> Summary:
    """Reduce ``record``; ``requests`` is how many were planned (timeouts included)."""
    done = [r for r in record.results if r.ok]
    duration = record.finished_at - record.started_at
    tokens = [r.tokens for r in done]
    gaps = [b - a for r in done for a, b in zip(r.event_times, r.event_times[1:], strict=False)]
    tpots = [(r.latency - r.ttft) / (r.tokens - 1) for r in done if r.tokens > 1]
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    errors = [r.error for r in record.results if r.error]
    return Summary(
        concurrency=record.concurrency,
        requests=requests,
        succeeded=len(done),
        timed_out=record.timed_out,
        duration_s=duration,
        output_tokens=sum(tokens),
        output_tok_s=sum(tokens) / duration if duration > 0 else math.nan,
        request_s=len(done) / duration if duration > 0 else math.nan,
        mean_prompt_tokens=sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else math.nan,
        min_output_tokens=min(tokens, default=0),
        max_output_tokens=max(tokens, default=0),
        text_events=sum(len(r.event_times) for r in done),
        cached_tokens=sum(cached) if cached else None,
        ttft_median_s=percentile([r.ttft for r in done], 50),
        ttft_p99_s=percentile([r.ttft for r in done], 99),
        itl_median_ms=percentile(gaps, 50) * 1e3,
        itl_p99_ms=percentile(gaps, 99) * 1e3,
        tpot_median_ms=percentile(tpots, 50) * 1e3,
        first_error=errors[0] if errors else None,
    )
