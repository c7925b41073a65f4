"""Start each server in turn, run the planned workloads against it, collect the results.

The plan (every prompt of every run) is built once, before any server starts, so every
server answers the same prompts in the same order. Runs never share prompts, and kvflow's
cache is flushed between runs, so only reuse within a run can hit the radix cache.
"""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .client import Endpoint, run_load
from .cpu import session_cpu_seconds
from .machine import load_average
from .servers import SERVERS, LaunchOptions, ServerSpec, running_server
from .stats import summarize
from .workloads import Corpus, Prompt, fixed_length_prompts, shared_prefix_prompts

__all__ = ["BenchConfig", "PlannedRun", "build_plan", "run_servers", "select_servers"]


@dataclass(frozen=True)
class BenchConfig:
    """Both workloads' shapes and how many requests each run sends, by concurrency."""

    concurrencies: tuple[int, ...] = (1, 32)
    input_len: int = 170
    output_len: int = 64
    fixed_requests: dict[int, int] = field(default_factory=lambda: {1: 8, 32: 32})
    shared_groups: dict[int, int] = field(default_factory=lambda: {1: 2, 32: 8})
    prefix_len: int = 1000
    question_len: int = 24
    shared_output_len: int = 64
    shared_requests: dict[int, int] = field(default_factory=lambda: {1: 8, 32: 32})
    api: str = "completions"
    run_timeout: float = 600.0
    warmup_requests: int = 2

    def requests(self, workload: str, concurrency: int) -> int:
        table = self.fixed_requests if workload == "fixed" else self.shared_requests
        return table.get(concurrency, 2 * concurrency)

    def groups(self, concurrency: int) -> int:
        """Prefix groups of a shared-prefix run (default 8)."""
        return self.shared_groups.get(concurrency, 8)


@dataclass(frozen=True)
class PlannedRun:
    """One (workload, concurrency) run: the exact prompts and output length."""

    workload: str  # fixed | shared | warmup
    concurrency: int
    max_tokens: int
    prompts: tuple[Prompt, ...]


def build_plan(corpus: Corpus, config: BenchConfig, workloads: set[str]) -> list[PlannedRun]:
    """Warm-up first, then the fixed-length runs, then the shared-prefix runs."""
    warmup = fixed_length_prompts(corpus, config.warmup_requests, config.input_len)
    plan = [PlannedRun("warmup", 1, 8, tuple(warmup))]
    for concurrency in config.concurrencies if "fixed" in workloads else ():
        count = config.requests("fixed", concurrency)
        prompts = fixed_length_prompts(corpus, count, config.input_len)
        plan.append(PlannedRun("fixed", concurrency, config.output_len, tuple(prompts)))
    for concurrency in config.concurrencies if "shared" in workloads else ():
        count = config.requests("shared", concurrency)
        prompts = shared_prefix_prompts(
            corpus, count, config.groups(concurrency), config.prefix_len, config.question_len
        )
        plan.append(PlannedRun("shared", concurrency, config.shared_output_len, tuple(prompts)))
    return plan


def select_servers(only: list[str] | None) -> list[ServerSpec]:
    """Servers named in ``only`` (``kvflow`` also selects ``kvflow-no-radix``); all if None."""
    if not only:
        return list(SERVERS.values())
    unknown = [
        name for name in only if not any(s == name or s.startswith(name + "-") for s in SERVERS)
    ]
    if unknown:
        raise SystemExit(f"unknown server(s) {unknown}; choose from {list(SERVERS)}")
    return [
        s for s in SERVERS.values() if any(s.name == n or s.name.startswith(n + "-") for n in only)
    ]


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


def _run_server(
    spec: ServerSpec,
    plan: list[PlannedRun],
    config: BenchConfig,
    opts: LaunchOptions,
    log_dir: Path,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with running_server(spec, opts, log_dir / f"{spec.name}.log") as server:
        base_url = server.base_url
        endpoint = Endpoint(base_url, config.api, _served_model(base_url), spec.extra_body)
        for run in plan:
            if run.workload != "warmup" and run.workload not in spec.workloads:
                continue
            _flush_cache(base_url)
            load, cpu_before = load_average(), session_cpu_seconds(server.session_id)
            record = run_load(
                endpoint, list(run.prompts), run.concurrency, run.max_tokens, config.run_timeout
            )
            summary = summarize(record, len(run.prompts))
            cpu_after = session_cpu_seconds(server.session_id)
            cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
            if run.workload == "warmup":
                if summary.succeeded == 0:
                    raise RuntimeError(f"{spec.name}: warm-up failed: {summary.first_error}")
                continue
            rows.append(
                {
                    "server": spec.name,
                    "workload": run.workload,
                    "load_average": load,
                    "server_cpu_s": cpu,
                    "cpu_ms_per_token": cpu * 1e3 / summary.output_tokens
                    if cpu is not None and summary.output_tokens
                    else None,
                    **summary.as_dict(),
                }
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
        f"CPU {row['cpu_ms_per_token'] or float('nan'):.0f} ms/tok  load {row['load_average']}",
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
