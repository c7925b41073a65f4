"""``POST /v1/completions``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvflow.runtime.server.bootstrap_fields import bootstraps_of
from kvflow.runtime.server.openai.common import (
    SampleResult,
    TokenText,
    collect,
    continuous_usage,
    new_id,
    now,
    sse,
    started,
    stream_chunk,
    usage_dict,
)
from kvflow.runtime.server.openai.protocol import CompletionRequest
from kvflow.runtime.server.tokenizer_manager import RequestHandle, TokenizerManager
from kvflow.runtime.wire import GenerateRequest, SamplingParams
from kvflow.runtime.wire.errors import RequestError

__all__ = ["completion", "prepare_completion"]


def _prompts(tm: TokenizerManager, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (string, list of strings, ids, list of ids)."""
    if isinstance(prompt, str):
        return [tm.tokenize(prompt)], [prompt]
    if not prompt:
        raise RequestError(400, "the prompt is empty")
    if isinstance(prompt[0], str):
        return [tm.tokenize(p) for p in prompt], list(prompt)
    ids_list = [list(prompt)] if isinstance(prompt[0], int) else [list(p) for p in prompt]
    for ids in ids_list:
        tm.check_token_ids(ids)  # before decoding them for echo
    return ids_list, [tm.decode(ids) for ids in ids_list]


def prepare_completion(
    tm: TokenizerManager, body: CompletionRequest
) -> tuple[list[GenerateRequest], list[str]]:
    if body.echo and body.logprobs is not None:
        raise RequestError(400, "echo together with logprobs (prompt logprobs) is not supported")
    ids_list, texts = _prompts(tm, body.prompt)
    bootstraps = bootstraps_of(
        body.bootstrap_host,
        body.bootstrap_port,
        body.bootstrap_room,
        len(ids_list),
        body.bootstrap_token,
    )
    inputs = []
    for ids, bootstrap in zip(ids_list, bootstraps, strict=True):
        max_tokens = (
            body.max_tokens if body.max_tokens is not None else tm.default_max_tokens(len(ids))
        )
        try:
            sampling = SamplingParams.from_dict(body.sampling_dict(max_tokens))
        except ValueError as err:
            raise RequestError(400, str(err)) from err
        inputs.append(
            GenerateRequest(
                input_ids=ids,
                sampling=sampling,
                rid=body.rid,
                stream=body.stream,
                return_logprob=body.logprobs is not None,
                top_logprobs_num=body.logprobs or 0,
                extra_key=body.cache_namespace,
                lora_path=tm.adapter_of(body.model, body.lora_path),
                bootstrap=bootstrap,
            )
        )
    return inputs, texts


def _logprobs(ids, logprobs, tops, token_text: TokenText, offset: int) -> dict[str, Any]:
    tokens = [token_text(t) for t in ids]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [{token_text(t): lp for t, lp in (top or [])} for top in tops],
        "text_offset": offsets,
    }


async def completion(
    tm: TokenizerManager,
    body: CompletionRequest,
    inputs: list[GenerateRequest],
    prompt_texts: list[str],
    handles: list[RequestHandle],
) -> dict[str, Any] | AsyncIterator[str]:
    model = body.model or tm.args.model_name
    n = body.n
    if body.stream:
        prompt_lengths = [len(inp.input_ids) for inp in inputs]
        return _stream(tm, body, prompt_texts, prompt_lengths, handles, model, n)
    results = await collect(handles)
    choices = []
    for i, result in enumerate(results):
        prefix = prompt_texts[i // n] if body.echo else ""
        choices.append(
            {
                "index": i,
                "text": prefix + result.text,
                "logprobs": _logprobs(
                    result.token_ids,
                    result.logprobs,
                    result.top_logprobs,
                    tm.token_text,
                    len(prefix),
                )
                if body.logprobs is not None
                else None,
                "finish_reason": result.finish_reason,
                "matched_stop": result.matched_stop,
            }
        )
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage_dict(results, n),
    }


async def _stream(
    tm: TokenizerManager,
    body: CompletionRequest,
    prompt_texts: list[str],
    prompt_lengths: list[int],
    handles: list[RequestHandle],
    model: str,
    n: int,
) -> AsyncIterator[str]:
    chunk_id, created = new_id("cmpl"), now()
    results = [SampleResult(prompt_tokens=prompt_lengths[i // n]) for i in range(len(handles))]
    offsets = [0] * len(handles)
    every_chunk_usage = continuous_usage(body.stream_options)

    def chunk(index: int, text: str, finish: str | None, logprobs=None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        usage = results[index] if every_chunk_usage else None
        return stream_chunk((chunk_id, created, model), "text_completion", choice, usage)

    outputs = await started(handles)  # nothing is sent before the first output
    if body.echo:
        for index in range(len(handles)):
            yield chunk(index, prompt_texts[index // n], None)
    async for index, out in outputs:
        results[index].add(out)
        logprobs = None
        if body.logprobs is not None and out.new_token_ids:
            logprobs = _logprobs(
                out.new_token_ids,
                out.new_logprobs,
                out.new_top_logprobs,
                tm.token_text,
                offsets[index],
            )
        offsets[index] += len(out.text_delta)
        finish = out.finish_reason.type if out.finish_reason else None
        if out.text_delta or logprobs or finish:
            yield chunk(index, out.text_delta, finish, logprobs)
    if body.stream_options and body.stream_options.include_usage:
        yield sse(
            {
                "id": chunk_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage_dict(results, n),
            }
        )
    yield sse("[DONE]")
