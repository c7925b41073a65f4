"""Part 1: what a router adds in front of a fast upstream (the load target).

One load target and every router start once; each round runs every concurrency against
every path (direct, then each router), the order of paths rotated from round to round, so
each router's numbers sit next to a direct run taken moments before or after. CPU time is
read from ``/proc`` for the router's process tree, the target's, this client and the
whole machine around the measured part of each run.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving import cpu_sample, load_average, percentile, session_cpu_seconds
from serving.servers import free_port

from .procs import Launch, Started, started
from .routers import kvflow_baseline_router, kvflow_router, sglang_router
from .streams import StreamRun, run_streams

__all__ = ["OverheadConfig", "run_overhead"]


@dataclass(frozen=True)
class OverheadConfig:
    """Shape of the overhead runs."""

    concurrencies: tuple[int, ...] = (1, 32, 256)
    rounds: int = 2
    duration_s: float = 6.0
    warmup_s: float = 1.0
    chunks: int = 16
    interval_ms: float = 2.0
    kvflow_policies: tuple[str, ...] = ("round_robin", "cache_aware")
    sglang_policies: tuple[str, ...] = ("round_robin", "cache_aware")
    baseline: str | None = None  # a revision whose kvflow router also runs ("kvflow@REV-...")


def _launches(
    config: OverheadConfig,
    target_url: str,
    sglang_python: Path | None,
    baseline_runtime: Path | None,
) -> list[Launch]:
    routers = [
        kvflow_router(f"kvflow-{p}", p, [target_url], sys.executable)
        for p in config.kvflow_policies
    ]
    if baseline_runtime is not None:
        routers += [
            kvflow_baseline_router(
                f"kvflow@{config.baseline}-{p}", p, [target_url], sys.executable, baseline_runtime
            )
            for p in config.kvflow_policies
        ]
    if sglang_python is not None:
        routers += [
            sglang_router(f"sglang-router-{p}", p, [target_url], sglang_python)
            for p in config.sglang_policies
        ]
    return routers


def _run_uvloop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _measure(
    path: str, base_url: str, router: Started | None, target: Started, c: int, cfg: OverheadConfig
) -> dict[str, Any]:
    session = router.pid if router is not None else target.pid
    marks: dict[str, Any] = {}

    def mark() -> None:
        marks["cpu"] = cpu_sample(session)
        marks["target"] = session_cpu_seconds(target.pid)

    load = load_average()
    run: StreamRun = _run_uvloop(run_streams(base_url, c, cfg.duration_s, cfg.warmup_s, mark))
    after, target_after = cpu_sample(session), session_cpu_seconds(target.pid)
    before = marks["cpu"]
    router_cpu = after.server_since(before) if router is not None else None
    target_cpu = (
        target_after - marks["target"]
        if target_after is not None and marks["target"] is not None
        else None
    )
    others = after.others_share_since(before)  # besides the measured session and client
    if router is not None and others is not None and target_cpu is not None:
        cores_s = (after.at - before.at) * (os.cpu_count() or 1)
        others = max(0.0, others - target_cpu / cores_s)  # the target is ours too
    return {
        "path": path,
        "concurrency": c,
        "load_average": load,
        "requests": run.requests,
        "errors": run.errors,
        "first_error": run.first_error,
        "timed_out": run.timed_out,
        "measured_s": run.measured_s,
        "request_s": run.requests / run.measured_s if run.measured_s > 0 else None,
        "ttfb_p50_ms": percentile(run.ttfb_ms, 50),
        "ttfb_p99_ms": percentile(run.ttfb_ms, 99),
        "chunk_p50_ms": percentile(run.chunk_ms, 50),
        "chunk_p99_ms": percentile(run.chunk_ms, 99),
        "chunks": len(run.chunk_ms),
        "router_cpu_s": router_cpu,
        "target_cpu_s": target_cpu,
        "client_cpu_s": after.client - before.client,
        "others_cpu_pct": None if others is None else others * 100,
        "request_s_per_router_core": run.requests / router_cpu if router_cpu else None,
    }


def _print(row: dict[str, Any], round_no: int) -> None:
    per_core = row["request_s_per_router_core"]
    print(
        f"  r{round_no} c={row['concurrency']:<3} {row['path']:<26} ok {row['requests']:>6} "
        f"err {row['errors']}  {row['request_s'] or 0:8.1f} req/s  "
        f"TTFB p50 {row['ttfb_p50_ms']:6.2f} p99 {row['ttfb_p99_ms']:7.2f} ms  "
        f"chunk p50 {row['chunk_p50_ms']:6.2f} p99 {row['chunk_p99_ms']:7.2f} ms  "
        f"router CPU {row['router_cpu_s'] or 0:5.2f} s ({per_core or 0:7.0f} req/s/core)  "
        f"others {row['others_cpu_pct'] or 0:3.0f}%  load {row['load_average']}",
        flush=True,
    )


def run_overhead(
    config: OverheadConfig,
    sglang_python: Path | None,
    log_dir: Path,
    baseline_runtime: Path | None = None,
) -> list[dict[str, Any]]:
    """Every round, concurrency and path; one row each (``round`` numbered from 1).

    ``baseline_runtime``: the ``runtime/`` folder of ``config.baseline``'s router, whose
    routers then run beside the current ones."""
    port = free_port()
    target = Launch(
        "load-target",
        [
            sys.executable,
            "-P",
            str(Path(__file__).with_name("loadtarget.py")),
            "--port",
            str(port),
            "--chunks",
            str(config.chunks),
            "--interval-ms",
            str(config.interval_ms),
        ],
        f"http://127.0.0.1:{port}",
    )
    rows: list[dict[str, Any]] = []
    with (
        started([target], log_dir) as (target_proc,),
        started(
            _launches(config, target.base_url, sglang_python, baseline_runtime), log_dir
        ) as routers,
    ):
        paths: list[tuple[str, str, Started | None]] = [("direct", target.base_url, None)]
        paths += [(r.launch.name, r.base_url, r) for r in routers]
        for round_no in range(1, config.rounds + 1):
            print(f"== overhead round {round_no} (load average {load_average()})", flush=True)
            shift = (round_no - 1) % len(paths)
            order = paths[shift:] + paths[:shift]
            for c in config.concurrencies:
                for name, url, router in order:
                    row = _measure(name, url, router, target_proc, c, config)
                    rows.append({"round": round_no, **row})
                    _print(rows[-1], round_no)
    return rows
