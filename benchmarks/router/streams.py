"""Closed-loop streaming client for the overhead runs: time to first byte, per-chunk latency.

``concurrency`` tasks each send a streaming chat request, read it to the end and send the
next, for ``warmup_s + duration_s``; only requests sent after the warm-up count. Every
event of the load target carries ``"sent_ns"`` (``time.monotonic_ns()`` when the target
wrote it), so a chunk's latency is its one-way time from the target's write to this
client's read, whatever is in between (nothing, or a router).

    send ──▶ first body byte (TTFB) ──▶ event k received: now_ns - sent_ns (chunk latency)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

__all__ = ["StreamRun", "run_streams"]

_STAMP = b'"sent_ns":'
_BODY = (
    b'{"model":"load-target","messages":[{"role":"user","content":"hello"}],'
    b'"max_tokens":16,"stream":true}'
)


@dataclass
class StreamRun:
    """What one run saw; times in milliseconds."""

    concurrency: int
    measured_s: float = 0.0
    requests: int = 0
    errors: int = 0
    first_error: str | None = None
    ttfb_ms: list[float] = field(default_factory=list)
    chunk_ms: list[float] = field(default_factory=list)
    timed_out: bool = False


def _stamps(buffer: bytes, now_ns: int, into: list[float]) -> bytes:
    """Record the latency of every complete event in ``buffer``; return the incomplete rest."""
    while (end := buffer.find(b"\n\n")) >= 0:
        event, buffer = buffer[:end], buffer[end + 2 :]
        at = event.find(_STAMP)
        if at >= 0:
            digits = event[at + len(_STAMP) :].split(b"}", 1)[0]
            into.append((now_ns - int(digits)) / 1e6)
    return buffer


async def _one(session: aiohttp.ClientSession, url: str, run: StreamRun, counted: bool) -> None:
    sent = time.monotonic_ns()
    ttfb: float | None = None
    chunks: list[float] = []
    try:
        async with session.post(
            url, data=_BODY, headers={"Content-Type": "application/json"}
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            buffer = b""
            async for data in response.content.iter_any():
                now = time.monotonic_ns()
                if ttfb is None:
                    ttfb = (now - sent) / 1e6
                buffer = _stamps(buffer + data, now, chunks)
        if not chunks:
            raise RuntimeError("no stamped events in the stream")
    except (aiohttp.ClientError, RuntimeError, ValueError) as exc:
        if counted:
            run.errors += 1
            run.first_error = run.first_error or f"{type(exc).__name__}: {exc}"[:300]
        return
    if counted:
        run.requests += 1
        run.ttfb_ms.append(ttfb if ttfb is not None else 0.0)
        run.chunk_ms.extend(chunks)


async def run_streams(
    base_url: str,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    on_measure_start=None,  # type: ignore[no-untyped-def]
    timeout_s: float = 60.0,
) -> StreamRun:
    """One run; ``on_measure_start()`` is called when the warm-up ends (take CPU samples)."""
    run = StreamRun(concurrency)
    url = base_url + "/v1/chat/completions"
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            while (now := loop.time()) < stop_at:
                await _one(session, url, run, counted=now >= measure_from)

        async def mark() -> None:
            await asyncio.sleep(warmup_s)
            if on_measure_start is not None:
                on_measure_start()

        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        marker = asyncio.create_task(mark())
        try:
            _done, pending = await asyncio.wait(tasks, timeout=warmup_s + duration_s + timeout_s)
            run.timed_out = bool(pending)
        finally:
            for task in [*tasks, marker]:
                task.cancel()
            await asyncio.gather(*tasks, marker, return_exceptions=True)
        run.measured_s = loop.time() - measure_from
    return run
