"""Closed-loop streaming load against an OpenAI-compatible server.

``concurrency`` workers share one queue of prompts; each sends its next request as soon as
the previous one has finished, so exactly ``concurrency`` requests are in flight until the
queue drains. Every request streams (server-sent events); the client stamps each event
that carries text, so TTFT and inter-token gaps are what a user of the API would see.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .workloads import Prompt

__all__ = ["Endpoint", "RequestResult", "RunRecord", "run_load"]


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests.

    ``extra_body`` is merged into every request body: it carries what makes a server
    produce exactly ``max_tokens`` tokens (``ignore_eos`` for kvflow/SGLang/vLLM, a
    ``generation_config`` for ``transformers serve``).
    """

    base_url: str
    api: str = "completions"  # completions | chat
    model: str | None = None  # None: leave the field out (single-model servers)
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None

    def body(self, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.api == "chat":
            messages = [{"role": "system", "content": prompt.prefix}] if prompt.prefix else []
            body["messages"] = [*messages, {"role": "user", "content": prompt.suffix}]
        else:
            body["prompt"] = prompt.text
        if self.model is not None:
            body["model"] = self.model
        return {**body, **self.extra_body}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"


@dataclass
class RequestResult:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds."""

    sent_at: float
    finished_at: float = 0.0
    event_times: list[float] = field(default_factory=list)  # events carrying text
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.event_times)

    @property
    def ttft(self) -> float:
        return self.event_times[0] - self.sent_at

    @property
    def latency(self) -> float:
        return self.finished_at - self.sent_at

    @property
    def tokens(self) -> int:
        """Output tokens: the server's usage count, else one per text event."""
        return self.output_tokens if self.output_tokens is not None else len(self.event_times)


@dataclass(frozen=True)
class RunRecord:
    """All requests of one run and the wall-clock span from first send to last finish."""

    concurrency: int
    max_tokens: int
    started_at: float
    finished_at: float
    results: list[RequestResult]
    timed_out: bool = False


def _event_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _apply_event(result: RequestResult, event: dict[str, Any], now: float) -> None:
    if "error" in event:
        result.error = json.dumps(event["error"])[:300]
        return
    if _event_text(event):
        result.event_times.append(now)
    for choice in event.get("choices") or []:
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")


async def _one_request(client: httpx.AsyncClient, endpoint: Endpoint, body: dict) -> RequestResult:
    result = RequestResult(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", endpoint.path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    _apply_event(result, json.loads(payload), time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.finished_at = time.perf_counter()
    if result.error is None and not result.event_times:
        result.error = "no text in the stream"
    return result


async def _run(
    endpoint: Endpoint, prompts: list[Prompt], concurrency: int, max_tokens: int, timeout: float
) -> RunRecord:
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    queue = list(reversed(prompts))
    results: list[RequestResult] = []

    # NOTE: trust_env=False: a proxy from the environment would sit inside every measurement.
    async with httpx.AsyncClient(
        base_url=endpoint.base_url,
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(timeout),
        trust_env=False,
    ) as client:

        async def worker() -> None:
            while queue:
                results.append(
                    await _one_request(client, endpoint, endpoint.body(queue.pop(), max_tokens))
                )

        started_at = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        try:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
        finally:  # the timeout, or Ctrl-C cancelling this task: close every open stream
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finished_at = time.perf_counter()
    return RunRecord(concurrency, max_tokens, started_at, finished_at, results, bool(pending))


def run_load(
    endpoint: Endpoint,
    prompts: list[Prompt],
    concurrency: int,
    max_tokens: int,
    timeout: float = 600.0,
) -> RunRecord:
    """Send every prompt once with ``concurrency`` clients; stop all after ``timeout`` seconds.

    Requests cut off by the timeout are not in the record (``timed_out`` says so).
    """
    return asyncio.run(_run(endpoint, prompts, concurrency, max_tokens, timeout))
