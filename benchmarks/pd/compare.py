"""PD vs unified on the same prompts, alternating which goes first each round.

Cells are (prompt length, concurrency). Each round takes fresh prompts from the corpus (no
prefix-cache hits across rounds or cells) and sends the same ones to both configurations,
cell by cell, the order of the two flipping every round. Around each PD run the prefill's
``/metrics`` is scraped: the KV writes' bytes, seconds and count of that run alone.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from serving import (
    Corpus,
    Endpoint,
    fixed_length_prompts,
    load_average,
    run_load,
    summarize,
)

from .scrape import scrape, since
from .stack import pd_stack

__all__ = ["CONFIGS", "CompareConfig", "run_compare"]

CONFIGS = ("unified", "pd")


@dataclass(frozen=True)
class CompareConfig:
    model: str
    input_lens: tuple[int, ...] = (256, 1024, 2048)
    concurrencies: tuple[int, ...] = (1, 4)
    requests_per_client: int = 1
    min_requests: int = 2  # per cell, so a 1-client cell still has a p99 of two
    output_len: int = 32
    rounds: int = 2
    server_args: tuple[str, ...] = ("--max-total-tokens", "24000", "--context-length", "4096")
    python: str = "python"
    log_dir: Path = Path("/tmp/kvflow-bench-pd")
    run_timeout_s: float = 300.0
    cells: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        cells = tuple((n, c) for c in self.concurrencies for n in self.input_lens)
        object.__setattr__(self, "cells", cells)


def _transfer(delta: dict[str, float], prompt_tokens: int, mean_ttft_s: float) -> dict[str, Any]:
    """The run's KV writes, from the prefill's counters."""
    nbytes = delta["kvflow:kv_transfer_bytes_total"]
    seconds = delta["kvflow:kv_transfer_seconds_sum"]
    writes = delta["kvflow:kv_transfer_seconds_count"]
    mean_ms = seconds / writes * 1e3 if writes else math.nan
    return {
        "writes": int(writes),
        "failed": int(delta["sglang:num_transfer_failed_reqs_total"]),
        "bytes": int(nbytes),
        "seconds": seconds,
        "bytes_per_prompt_token": nbytes / prompt_tokens if prompt_tokens else math.nan,
        "ms_per_1k_prompt_tokens": seconds * 1e3 / (prompt_tokens / 1e3) if prompt_tokens else math.nan,
        "mean_ms": mean_ms,
        "share_of_mean_ttft": mean_ms / 1e3 / mean_ttft_s if mean_ttft_s else math.nan,
        "gb_s": nbytes / seconds / 1e9 if seconds else math.nan,
    }  # fmt: skip


def _one_run(
    cfg: CompareConfig, name: str, url: str, prefill: str, prompts: list, concurrency: int
) -> dict[str, Any]:
    endpoint = Endpoint(url, api="completions", extra_body={"ignore_eos": True})
    load_before = load_average()
    before = scrape(prefill) if name == "pd" else None
    record = run_load(endpoint, prompts, concurrency, cfg.output_len, cfg.run_timeout_s)
    summary = summarize(record, len(prompts))
    done = [r for r in record.results if r.ok]
    mean_ttft = sum(r.ttft for r in done) / len(done) if done else math.nan
    row: dict[str, Any] = {
        "config": name,
        "summary": summary.as_dict(),
        "mean_ttft_s": mean_ttft,
        "load_before": load_before,
        "load_after": load_average(),
    }
    if before is not None:
        time.sleep(0.6)  # the prefill's HTTP process hears its scheduler every 0.25 s
        prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
        row["transfer"] = _transfer(since(before, scrape(prefill)), prompt_tokens, mean_ttft)
    return row


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    """Every round and cell, both configurations; returns the JSON-ready results."""
    corpus = Corpus(Path(cfg.model) / "tokenizer.json")
    runs: list[dict[str, Any]] = []
    started_at = time.time()
    with pd_stack(cfg.python, cfg.model, list(cfg.server_args), cfg.log_dir) as stack:
        urls = {"unified": stack.unified, "pd": stack.pd}
        warm = fixed_length_prompts(corpus, 2, 64)
        for name in CONFIGS:  # first requests pay one-time costs (handshake, allocations)
            run_load(Endpoint(urls[name], extra_body={"ignore_eos": True}), warm, 1, 4, 120)
        for round_index in range(cfg.rounds):
            order = CONFIGS if round_index % 2 == 0 else CONFIGS[::-1]
            for input_len, concurrency in cfg.cells:
                count = max(cfg.min_requests, concurrency * cfg.requests_per_client)
                prompts = fixed_length_prompts(corpus, count, input_len)
                for name in order:
                    row = _one_run(cfg, name, urls[name], stack.prefill, prompts, concurrency)
                    row.update(round=round_index, input_len=input_len, concurrency=concurrency)
                    runs.append(row)
                    s = row["summary"]
                    print(
                        f"round {round_index} {name:7s} in={input_len:5d} c={concurrency} "
                        f"ttft p50 {s['ttft_median_s']:.2f}s p99 {s['ttft_p99_s']:.2f}s "
                        f"out {s['output_tok_s']:.1f} tok/s ok {s['succeeded']}/{s['requests']} "
                        f"load {row['load_before']}"
                        + (
                            f" xfer {row['transfer']['ms_per_1k_prompt_tokens']:.1f} ms/1k tok "
                            f"{row['transfer']['gb_s']:.2f} GB/s"
                            if "transfer" in row
                            else ""
                        ),
                        flush=True,
                    )
    config = {k: v for k, v in asdict(cfg).items() if k not in ("cells",)}
    config["log_dir"] = str(cfg.log_dir)
    return {
        "config": config,
        "started_at": started_at,
        "duration_s": time.time() - started_at,
        "nproc": os.cpu_count(),
        "runs": runs,
    }
