"""Part 2: what cache-aware routing is worth over real ``kvflow serve`` workers.

Four workers (the embedded model, one CPU thread each, a KV pool that holds about half of
the workload's shared prefixes) and one router per policy start once. Every run sends the
same shuffled shared-prefix prompts through one router, after ``POST /flush_cache`` on
every worker; the cache hit rate comes from the workers' own counters
(``sglang:cached_tokens_total / sglang:prompt_tokens_total``, deltas over the run), not
from any router's belief. The order of routers rotates from round to round.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from serving import (
    Corpus,
    Endpoint,
    Prompt,
    cpu_sample,
    load_average,
    run_load,
    shared_prefix_prompts,
    summarize,
)
from serving.servers import free_port

from .procs import Launch, Started, started
from .routers import kvflow_router, sglang_router

__all__ = ["CacheConfig", "run_cache_value"]

_COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:num_requests_total",
    "sglang:generation_tokens_total",
)


@dataclass(frozen=True)
class CacheConfig:
    """Workers, workload and runs of the cache-aware comparison."""

    model: str
    workers: int = 4
    worker_args: tuple[str, ...] = ("--cpu-threads", "1", "--max-total-tokens", "2048")
    groups: int = 8
    questions_per_group: int = 8
    prefix_len: int = 384
    question_len: int = 16
    output_len: int = 16
    concurrency: int = 8
    rounds: int = 2
    seed: int = 0
    run_timeout_s: float = 300.0
    kvflow_policies: tuple[str, ...] = ("cache_aware", "power_of_two", "round_robin")
    sglang_policies: tuple[str, ...] = ("cache_aware",)

    @property
    def requests(self) -> int:
        return self.groups * self.questions_per_group


def workload(config: CacheConfig) -> list[Prompt]:
    """The shared-prefix prompts in a fixed shuffled order (arrivals mix the groups)."""
    corpus = Corpus(Path(config.model) / "tokenizer.json")
    prompts = shared_prefix_prompts(
        corpus, config.requests, config.groups, config.prefix_len, config.question_len
    )
    random.Random(config.seed).shuffle(prompts)
    return prompts


def _counters(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30, trust_env=False).text
    totals = dict.fromkeys(_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _warm_up(base_url: str) -> None:
    """One short request straight to a worker, so no policy's run pays first-request costs."""
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    response = httpx.post(
        base_url + "/v1/chat/completions", json=body, timeout=120, trust_env=False
    )
    response.raise_for_status()


def _flush(base_url: str) -> None:
    response = httpx.post(base_url + "/flush_cache", timeout=60, trust_env=False)
    response.raise_for_status()


def _measure(
    name: str, router: Started, workers: list[Started], prompts: list[Prompt], cfg: CacheConfig
) -> dict[str, Any]:
    for worker in workers:
        _flush(worker.base_url)
    before = [_counters(w.base_url) for w in workers]
    load, cpu_before = load_average(), cpu_sample(router.pid)
    endpoint = Endpoint(router.base_url, "chat", None, {"ignore_eos": True})
    record = run_load(endpoint, prompts, cfg.concurrency, cfg.output_len, cfg.run_timeout_s)
    cpu_after = cpu_sample(router.pid)
    after = [_counters(w.base_url) for w in workers]
    delta = [{k: a[k] - b[k] for k in _COUNTERS} for a, b in zip(after, before, strict=True)]
    prompt_tokens = sum(d["sglang:prompt_tokens_total"] for d in delta)
    cached = sum(d["sglang:cached_tokens_total"] for d in delta)
    summary = summarize(record, len(prompts))
    busy = (
        (cpu_after.machine - cpu_before.machine) / (cpu_after.at - cpu_before.at)
        if cpu_after.machine is not None and cpu_before.machine is not None
        else None
    )
    return {
        "router": name,
        "load_average": load,
        "machine_busy_cores": busy,
        "router_cpu_s": cpu_after.server_since(cpu_before),
        "worker_prompt_tokens": prompt_tokens,
        "worker_cached_tokens": cached,
        "cache_hit_rate": cached / prompt_tokens if prompt_tokens else None,
        "requests_per_worker": [int(d["sglang:num_requests_total"]) for d in delta],
        **summary.as_dict(),
    }


def _print(row: dict[str, Any]) -> None:
    print(
        f"  r{row['round']} {row['router']:<26} ok {row['succeeded']}/{row['requests']}  "
        f"{row['output_tok_s']:6.2f} out tok/s  hit {100 * (row['cache_hit_rate'] or 0):5.1f}%  "
        f"per worker {row['requests_per_worker']}  TTFT med {row['ttft_median_s']:.2f} s  "
        f"{row['duration_s']:.0f} s  load {row['load_average']}",
        flush=True,
    )


def _worker(index: int, config: CacheConfig) -> Launch:
    port = free_port()
    argv = [sys.executable, "-P", "-m", "kvflow", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--model-path", config.model, *config.worker_args]
    return Launch(f"worker-{index}", argv, f"http://127.0.0.1:{port}")


def run_cache_value(
    config: CacheConfig, sglang_python: Path | None, log_dir: Path
) -> list[dict[str, Any]]:
    """Every round and router; one row each (``round`` numbered from 1)."""
    prompts = workload(config)
    rows: list[dict[str, Any]] = []
    launches = [_worker(i, config) for i in range(config.workers)]
    with started(launches, log_dir, ready_timeout=600) as workers:
        urls = [w.base_url for w in workers]
        for url in urls:
            _warm_up(url)
        routers = [
            kvflow_router(f"kvflow-{p}", p, urls, sys.executable) for p in config.kvflow_policies
        ]
        if sglang_python is not None:
            routers += [
                sglang_router(f"sglang-router-{p}", p, urls, sglang_python)
                for p in config.sglang_policies
            ]
        with started(routers, log_dir, ready_timeout=300) as running:
            for round_no in range(1, config.rounds + 1):
                print(
                    f"== cache-aware round {round_no} (load average {load_average()})", flush=True
                )
                shift = (round_no - 1) % len(running)
                for router in running[shift:] + running[:shift]:
                    row = _measure(router.launch.name, router, workers, prompts, config)
                    rows.append({"round": round_no, **row})
                    _print(rows[-1])
    return rows
