"""Shared by the chat and completions adapters: running samples, usage, logprobs, SSE."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.runtime.server.tokenizer_manager import RequestHandle
from kvflow.runtime.wire.messages import TextOutput

__all__ = [
    "SampleResult",
    "collect",
    "continuous_usage",
    "merge_streams",
    "new_id",
    "sample_usage",
    "sse",
    "started",
    "usage_dict",
]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(payload: dict[str, Any] | str) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"


@dataclass
class SampleResult:
    """Everything one finished sample produced."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_logprobs: list[float | None] | None = None  # prompt logprobs, when asked
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def add(self, out: TextOutput) -> None:
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top_logprobs += out.new_top_logprobs
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
            self.input_top_logprobs = out.input_top_logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.type
            self.matched_stop = out.finish_reason.matched


async def merge_streams(
    handles: list[RequestHandle],
) -> AsyncGenerator[tuple[int, TextOutput], None]:
    """Interleave the outputs of several samples as they arrive: ``(index, output)``."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for out in handle:
                await queue.put((index, out))
        except Exception as err:  # delivered to the consumer
            await queue.put((index, err))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()


async def started(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, TextOutput]]:
    """:func:`merge_streams` once its first output is there. A stream awaits this before
    its first chunk, and the server sends the status with that chunk, so a request aborted
    before its first output (a failed prefill/decode peer: 503, which a router may still
    retry; the client's own abort: 499) is answered with that status, not a 200. An abort
    later raises :class:`RequestError` mid-stream: the server sends an error event."""
    stream = merge_streams(handles)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return stream
    return _prepend(first, stream)


async def _prepend(
    first: tuple[int, TextOutput], rest: AsyncGenerator[tuple[int, TextOutput], None]
) -> AsyncIterator[tuple[int, TextOutput]]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def collect(handles: list[RequestHandle]) -> list[SampleResult]:
    """Every sample's whole result. An aborted sample raises its :class:`RequestError`
    (see the tokenizer manager: 499, 500 or 503), and so fails the whole answer."""
    results = [SampleResult() for _ in handles]
    async for index, out in merge_streams(handles):
        results[index].add(out)
    return results


def usage_dict(results: list[SampleResult], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per sample), as OpenAI does."""
    prompts = results[::n]
    prompt_tokens = sum(r.prompt_tokens for r in prompts)
    completion = sum(r.completion_tokens for r in results)
    cached = sum(
        max(r.cached_tokens for r in results[i : i + n]) for i in range(0, len(results), n)
    )
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sample_usage(result: SampleResult) -> dict[str, Any]:
    """One sample's usage so far (SGLang's ``continuous_usage_stats`` puts it on every chunk)."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def continuous_usage(stream_options: Any) -> bool:
    return bool(stream_options and stream_options.continuous_usage_stats)


def now() -> int:
    return int(time.time())


TokenText = Callable[[int], str]


def stream_chunk(
    ids: tuple[str, int, str],
    kind: str,
    choice: dict[str, Any],
    usage: SampleResult | None = None,
) -> str:
    """One SSE chunk of a streamed completion: ``ids`` is (id, created, model), ``kind`` the
    ``object``, ``choice`` its only choice; ``usage`` (the sample's so far) with
    ``stream_options.continuous_usage_stats``."""
    chunk_id, created, model = ids
    payload: dict[str, Any] = {
        "id": chunk_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        payload["usage"] = sample_usage(usage)
    return sse(payload)
