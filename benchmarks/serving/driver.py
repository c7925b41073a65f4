"""Start each server in turn, run the planned workloads against it, collect the results.

kvflow's cache is flushed between runs, so only reuse within a run can hit the radix cache.
"""

from __future__ import annotations

import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import httpx

from .client import Endpoint, run_load
from .cpu import cpu_sample
from .machine import load_average
from .plan import BenchConfig, PlannedRun
from .servers import LaunchOptions, RunningServer, ServerSpec, running_server
from .stats import summarize

__all__ = ["run_servers"]


def _served_model(base_url: str) -> str | None:
    """The id from ``/v1/models``; None (leave ``model`` out) where that fails."""
    try:
        response = httpx.get(base_url + "/v1/models", timeout=30, trust_env=False)
        return response.json()["data"][0]["id"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def _flush_cache(base_url: str) -> None:
    # Servers without one (transformers serve) keep no cross-request cache to flush.
    with suppress(httpx.HTTPError):
        httpx.post(base_url + "/flush_cache", timeout=30, trust_env=False)


def _measure(
    server: RunningServer, endpoint: Endpoint, run: PlannedRun, timeout: float
) -> dict[str, Any]:
    """One run against a fresh cache: the summary plus load and server CPU time."""
    _flush_cache(server.base_url)
    load, before = load_average(), cpu_sample(server.session_id)
    record = run_load(endpoint, list(run.prompts), run.concurrency, run.max_tokens, timeout)
    after = cpu_sample(server.session_id)
    summary = summarize(record, len(run.prompts))
    cpu = after.server_since(before)
    per_token = cpu * 1e3 / summary.output_tokens if cpu and summary.output_tokens else None
    others = after.others_share_since(before)
    return {
        "workload": run.workload,
        "load_average": load,
        "others_cpu_pct": None if others is None else others * 100,
        "server_cpu_s": cpu,
        "cpu_ms_per_token": per_token,
        **summary.as_dict(),
    }


def _run_server(
    spec: ServerSpec,
    plan: list[PlannedRun],
    config: BenchConfig,
    opts: LaunchOptions,
    log_dir: Path,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with running_server(spec, opts, log_dir / f"{spec.name}.log") as server:
        model = _served_model(server.base_url)
        endpoint = Endpoint(server.base_url, config.api, model, spec.extra_body)
        for run in plan:
            if run.workload == "warmup":
                row = _measure(server, endpoint, run, config.run_timeout)
                if row["succeeded"] == 0:
                    raise RuntimeError(f"{spec.name}: warm-up failed: {row['first_error']}")
            elif run.workload in spec.workloads:
                rows.append(
                    {"server": spec.name, **_measure(server, endpoint, run, config.run_timeout)}
                )
                _print_row(rows[-1])
    return rows


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"  {row['server']:<16} {row['workload']:<7} c={row['concurrency']:<3} "
        f"ok {row['succeeded']}/{row['requests']}  {row['output_tok_s']:8.2f} out tok/s  "
        f"TTFT med {row['ttft_median_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s  "
        f"ITL med {row['itl_median_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms  "
        f"out tok {row['min_output_tokens']}-{row['max_output_tokens']}  "
        f"CPU {row['cpu_ms_per_token'] or float('nan'):.0f} ms/tok  "
        f"others {row['others_cpu_pct'] or 0:.0f}% CPU  load {row['load_average']}",
        flush=True,
    )


def run_servers(
    specs: list[ServerSpec],
    plan: list[PlannedRun],
    config: BenchConfig,
    opts: LaunchOptions,
    log_dir: Path,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every selected server in turn; returns result rows and per-server failures."""
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for spec in specs:
        if not any(run.workload in spec.workloads for run in plan):
            continue  # none of its workloads selected
        print(f"== {spec.description} (load average {load_average()})", flush=True)
        started = time.monotonic()
        try:
            rows += _run_server(spec, plan, config, opts, log_dir)
        except RuntimeError as exc:
            failures[spec.name] = str(exc)
            print(f"  FAILED: {exc}", flush=True)
        print(f"   ({time.monotonic() - started:.0f} s)", flush=True)
    return rows, failures
