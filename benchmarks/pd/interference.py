"""Long-prefill interference, for the GPU machine (prefill and decode on separate GPUs):
decode ITL of a steady stream of requests, first alone ("quiet"), then while long prompts
keep arriving ("long prompts"), for each target (a PD router and a unified deployment,
both already running), alternating which target goes first each round.

In unified serving a long prompt's prefill shares the forward passes with the stream's
decode steps, so the stream's ITL p99 jumps by the prefill's duration; with PD it should
not move. Not meaningful on the 2-core CPU machine (prefill and decode share its cores).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from serving import Corpus, load_average, percentile

__all__ = ["InterferenceConfig", "run_interference"]


@dataclass(frozen=True)
class InterferenceConfig:
    targets: tuple[tuple[str, str], ...]  # (name, base URL of an OpenAI-compatible server)
    model: str  # folder with tokenizer.json (prompts of exact token length)
    stream_clients: int = 16
    stream_input_len: int = 256
    stream_output_len: int = 256
    long_input_len: int = 8192
    long_interval_s: float = 2.0
    phase_s: float = 60.0
    warmup_s: float = 5.0
    rounds: int = 2
    request_timeout_s: float = 600.0


_serial = itertools.count()


def _prompt(corpus: Corpus, num_tokens: int) -> str:
    """About ``num_tokens`` of text; the corpus (~100k tokens) wraps around, and a serial
    number up front keeps repeated text from hitting a prefix cache."""
    try:
        text = corpus.take(num_tokens)
    except ValueError:
        corpus.cursor = 0
        text = corpus.take(num_tokens)
    return f"{next(_serial)}. {text}"


async def _stream(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, times: list[float]
) -> float | None:
    """One streamed completion; appends the time of every text event; returns its TTFT."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body["ignore_eos"] = True
    sent = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or []
            if choices and choices[0].get("text"):
                now = time.perf_counter()
                times.append(now)
                first = first if first is not None else now - sent
    return first


async def _phase(cfg: InterferenceConfig, url: str, corpus: Corpus, long: bool) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=cfg.stream_clients + 64)
    timeout = httpx.Timeout(cfg.request_timeout_s)
    gaps: list[float] = []
    long_ttfts: list[float] = []
    errors: list[str] = []
    stream_tokens = 0
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        start = time.perf_counter()
        window = (start + cfg.warmup_s, start + cfg.warmup_s + cfg.phase_s)

        async def stream_client() -> None:
            nonlocal stream_tokens
            while time.perf_counter() < window[1]:
                times: list[float] = []
                try:
                    await _stream(
                        client, _prompt(corpus, cfg.stream_input_len), cfg.stream_output_len, times
                    )
                except (httpx.HTTPError, RuntimeError) as err:
                    errors.append(str(err)[:200])
                inside = [t for t in times if window[0] <= t <= window[1]]
                stream_tokens += len(inside)
                gaps.extend(b - a for a, b in itertools.pairwise(inside))

        async def long_prompt() -> None:
            try:
                ttft = await _stream(client, _prompt(corpus, cfg.long_input_len), 1, [])
                if ttft is not None:
                    long_ttfts.append(ttft)
            except (httpx.HTTPError, RuntimeError) as err:
                errors.append(str(err)[:200])

        async def long_arrivals() -> None:
            await asyncio.sleep(cfg.warmup_s)
            pending = []
            while time.perf_counter() < window[1]:
                pending.append(asyncio.create_task(long_prompt()))
                await asyncio.sleep(cfg.long_interval_s)
            await asyncio.gather(*pending)

        tasks = [stream_client() for _ in range(cfg.stream_clients)]
        await asyncio.gather(*tasks, *([long_arrivals()] if long else []))
    return {
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "itl_max_ms": max(gaps, default=float("nan")) * 1e3,
        "stream_tok_s": stream_tokens / cfg.phase_s,
        "long_prompts": len(long_ttfts),
        "long_ttft_p50_s": percentile(long_ttfts, 50),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def run_interference(cfg: InterferenceConfig) -> dict[str, Any]:
    corpus = Corpus(Path(cfg.model) / "tokenizer.json")
    runs = []
    for round_index in range(cfg.rounds):
        order = cfg.targets if round_index % 2 == 0 else cfg.targets[::-1]
        for name, url in order:
            for phase in ("quiet", "long prompts"):
                load = load_average()
                result = asyncio.run(_phase(cfg, url, corpus, long=phase != "quiet"))
                runs.append(
                    {"round": round_index, "target": name, "phase": phase, "load": load, **result}
                )
                print(f"round {round_index} {name} {phase}: {result}", flush=True)
    return {"mode": "interference", "config": asdict(cfg), "runs": runs}
