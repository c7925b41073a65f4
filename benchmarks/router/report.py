"""Render the router benchmark's JSON as markdown (a pure function of the JSON).

The JSON holds ``command``, ``date``, ``machine``, ``overhead`` (config and rows),
``cache`` (config and rows), ``failures`` and optional hand-written ``notes``. Ratios are
taken within a round only (the machine is shared; rounds can differ a lot).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["render_markdown"]


def _fmt(value: Any, spec: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return spec.format(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _overhead_raw(rows: list[dict[str, Any]]) -> list[str]:
    header = ["round", "streams", "path", "ok (err)", "req/s", "TTFB p50 ms", "TTFB p99 ms"]
    header += ["chunk p50 ms", "chunk p99 ms", "router CPU s", "req/s per router core"]
    header += ["target CPU s", "client CPU s", "other jobs' CPU %", "load avg (1, 5, 15 min)"]
    body = [
        [
            str(r["round"]),
            str(r["concurrency"]),
            r["path"],
            f"{r['requests']} ({r['errors']})",
            _fmt(r["request_s"], "{:.0f}"),
            _fmt(r["ttfb_p50_ms"]),
            _fmt(r["ttfb_p99_ms"]),
            _fmt(r["chunk_p50_ms"]),
            _fmt(r["chunk_p99_ms"]),
            _fmt(r["router_cpu_s"]),
            _fmt(r["request_s_per_router_core"], "**{:.0f}**"),
            _fmt(r["target_cpu_s"]),
            _fmt(r["client_cpu_s"]),
            _fmt(r["others_cpu_pct"], "{:.0f}"),
            r["load_average"],
        ]
        for r in rows
    ]
    return _table(header, body)


def _overhead_added(rows: list[dict[str, Any]]) -> list[str]:
    """Each router minus the direct run of the same round and concurrency."""
    direct = {(r["round"], r["concurrency"]): r for r in rows if r["path"] == "direct"}
    by_key = {(r["round"], r["concurrency"], r["path"]): r for r in rows}
    header = ["round", "streams", "router", "added TTFB p50 ms", "added TTFB p99 ms"]
    header += [
        "added chunk p50 ms",
        "added chunk p99 ms",
        "req/s per core",
        "kvflow / sglang-router per core (same policy)",
    ]
    body = []
    for r in rows:
        base = direct.get((r["round"], r["concurrency"]))
        if r["path"] == "direct" or base is None:
            continue
        ratio = "–"
        if r["path"].startswith("kvflow-"):
            peer = by_key.get(
                (r["round"], r["concurrency"], "sglang-router-" + r["path"].removeprefix("kvflow-"))
            )
            mine, theirs = (
                r["request_s_per_router_core"],
                peer and peer["request_s_per_router_core"],
            )
            ratio = _fmt(mine / theirs if mine and theirs else None, "**{:.2f}x**")
        body.append(
            [
                str(r["round"]),
                str(r["concurrency"]),
                r["path"],
                _fmt(r["ttfb_p50_ms"] - base["ttfb_p50_ms"], "{:+.2f}"),
                _fmt(r["ttfb_p99_ms"] - base["ttfb_p99_ms"], "{:+.2f}"),
                _fmt(r["chunk_p50_ms"] - base["chunk_p50_ms"], "{:+.2f}"),
                _fmt(r["chunk_p99_ms"] - base["chunk_p99_ms"], "{:+.2f}"),
                _fmt(r["request_s_per_router_core"], "{:.0f}"),
                ratio,
            ]
        )
    return _table(header, body)


def _cache_raw(rows: list[dict[str, Any]]) -> list[str]:
    header = ["round", "router (policy)", "ok", "out tok", "time s", "**out tok/s**"]
    header += ["worker cache hit rate", "requests per worker", "TTFT med s", "TTFT p99 s"]
    header += ["machine busy cores", "load avg (1, 5, 15 min)"]
    body = [
        [
            str(r["round"]),
            r["router"],
            f"{r['succeeded']}/{r['requests']}" + (" (timed out)" if r["timed_out"] else ""),
            str(r["output_tokens"]),
            _fmt(r["duration_s"], "{:.1f}"),
            _fmt(r["output_tok_s"], "**{:.2f}**"),
            _fmt(r["cache_hit_rate"] and 100 * r["cache_hit_rate"], "{:.1f}%"),
            " / ".join(map(str, r["requests_per_worker"])),
            _fmt(r["ttft_median_s"]),
            _fmt(r["ttft_p99_s"]),
            _fmt(r["machine_busy_cores"]),
            r["load_average"],
        ]
        for r in rows
    ]
    return _table(header, body)


def _cache_ratios(rows: list[dict[str, Any]], baseline: str) -> list[str]:
    base = {r["round"]: r for r in rows if r["router"] == baseline}
    header = ["round", "router (policy)", f"out tok/s / {baseline}'s", "hit rate"]
    body = []
    for r in rows:
        b = base.get(r["round"])
        if b is None or r is b:
            continue
        ratio = r["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else None
        body.append(
            [
                str(r["round"]),
                r["router"],
                _fmt(ratio, "**{:.2f}x**"),
                _fmt(r["cache_hit_rate"] and 100 * r["cache_hit_rate"], "{:.1f}%"),
            ]
        )
    return _table(header, body)


def _config(config: dict[str, Any]) -> list[str]:
    return [f"- {key}: `{value}`" for key, value in config.items()]


def render_markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Router benchmark: `kvflow router` vs `sglang-router`",
        "",
        "Generated by `benchmarks/bench_router.py`; numbers are measured, never edited.",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"Run on {doc['date']}.",
        "",
        "## Machine",
        "",
        *[f"- {key}: {value}" for key, value in doc["machine"].items()],
        "",
        "The machine is shared with other engineers' jobs: every row carries the load average",
        "at its start and the share of all cores other jobs used during it. Ratios are taken",
        "within one round only.",
    ]
    for name, failure in doc.get("failures", {}).items():
        lines += ["", f"**{name} failed:**", "", "```", failure, "```"]
    overhead = doc.get("overhead")
    if overhead:
        lines += [
            "",
            "## 1. Overhead in front of a fast upstream",
            "",
            "The upstream is a **load target written for this benchmark**",
            "(`benchmarks/router/loadtarget.py`, aiohttp + uvloop, one process), not a model: it",
            "answers a streaming chat request at once with `chunks` SSE events `interval_ms`",
            "apart, each stamped with its write time (CLOCK_MONOTONIC). The client",
            "(`benchmarks/router/streams.py`, aiohttp + uvloop, one process) runs `streams`",
            "closed-loop streams for `warmup_s + duration_s` and counts requests sent after the",
            "warm-up. TTFB: send to first body byte. Chunk latency: the target's write of an",
            "event to the client's read of it (one-way, every event). Router CPU: user + system",
            "time of the router's process tree over the measured part; req/s per router core =",
            "counted requests / router CPU seconds. Client, target and router share the 2 cores",
            "with each other and with other jobs, so latencies include CPU queueing.",
            "",
            *_config(overhead["config"]),
            "",
            "### Added over direct (same round, same stream count)",
            "",
            *_overhead_added(overhead["rows"]),
            "",
            "### Every run",
            "",
            *_overhead_raw(overhead["rows"]),
        ]
    cache = doc.get("cache")
    if cache:
        lines += [
            "",
            "## 2. Cache-aware routing over 4 `kvflow serve` workers",
            "",
            "Four workers of the embedded model on this machine, one router per policy in front",
            "of the same workers; every run sends the same shuffled shared-prefix prompts (chat",
            "API, the shared text as the system message, a distinct question as the user message,",
            "`ignore_eos`), after `POST /flush_cache` on every worker. Cache hit rate: the",
            "workers' own `sglang:cached_tokens_total / sglang:prompt_tokens_total` over the run.",
            "",
            *_config(cache["config"]),
            "",
            "### Ratios (same round)",
            "",
            *_cache_ratios(cache["rows"], "kvflow-round_robin"),
            "",
            "### Every run",
            "",
            *_cache_raw(cache["rows"]),
        ]
    if doc.get("notes"):
        lines += ["", "## Observations (written by hand after the run)", "", doc["notes"].rstrip()]
    return "\n".join(lines) + "\n"
