"""``POST /v1/chat/completions``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvflow.runtime.server.bootstrap_fields import bootstrap_of
from kvflow.runtime.server.openai.chat_output import ChatOutputStream, shape_message
from kvflow.runtime.server.openai.chat_plan import ChatPlan, content_text, plan_chat
from kvflow.runtime.server.openai.common import (
    SampleResult,
    collect,
    continuous_usage,
    new_id,
    now,
    sse,
    started,
    stream_chunk,
    usage_dict,
)
from kvflow.runtime.server.openai.protocol import ChatCompletionRequest
from kvflow.runtime.server.tokenizer_manager import RequestHandle, TokenizerManager
from kvflow.runtime.wire import GenerateRequest, SamplingParams
from kvflow.runtime.wire.errors import RequestError
from kvflow.runtime.wire.sampling import GRAMMAR_FIELDS

__all__ = ["chat_completion", "prepare_chat"]


def prepare_chat(
    tm: TokenizerManager, body: ChatCompletionRequest
) -> tuple[GenerateRequest, ChatPlan]:
    plan = plan_chat(body, tm.args.tool_call_parser, tm.args.reasoning_parser)
    template = getattr(tm.tokenizer, "chat_template", None) or ""
    messages, template_kwargs = plan.render_messages(body.messages, "tools" in template)
    if body.reasoning_effort is not None:
        template_kwargs["reasoning_effort"] = body.reasoning_effort
    template_kwargs.update(_continuation(body))
    ids = tm.chat_ids(messages, **{**(body.chat_template_kwargs or {}), **template_kwargs})
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = tm.default_max_tokens(len(ids))
    values = body.sampling_dict(max_tokens)
    if (schema := plan.json_schema()) is not None:
        if any(values.get(k) is not None for k in GRAMMAR_FIELDS):
            raise RequestError(
                400,
                "tool_choice 'required' or a named function is a constraint of its own: "
                "it cannot be combined with response_format, regex or ebnf",
            )
        values["json_schema"] = schema
    try:
        sampling = SamplingParams.from_dict(values)
    except ValueError as err:
        raise RequestError(400, str(err)) from err
    want_logprobs = body.logprobs or bool(body.top_logprobs)
    inp = GenerateRequest(
        input_ids=ids,
        sampling=sampling,
        rid=body.rid,
        stream=body.stream,
        return_logprob=want_logprobs,
        top_logprobs_num=body.top_logprobs or 0,
        extra_key=body.cache_namespace,
        lora_path=tm.adapter_of(body.model, body.lora_path),
        bootstrap=bootstrap_of(
            body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, body.bootstrap_token
        ),
    )
    return inp, plan


def _continuation(body: ChatCompletionRequest) -> dict[str, bool]:
    """``continue_final_message``: the prompt ends inside the last (assistant) message, so
    the answer continues its text; vLLM's ``add_generation_prompt`` (default: true unless
    continuing) cannot be true then."""
    if not body.continue_final_message:
        if body.add_generation_prompt is None:
            return {}
        return {"add_generation_prompt": body.add_generation_prompt}
    if body.add_generation_prompt:
        raise RequestError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true: "
            "continuing the last message adds no new turn",
        )
    last = body.messages[-1]
    if last.role != "assistant" or last.tool_calls or not content_text(last).strip():
        raise RequestError(
            400,
            "continue_final_message needs the last message to be the assistant's, with text "
            "content to continue (and no tool_calls)",
        )
    return {"add_generation_prompt": False, "continue_final_message": True}


def _logprobs(result_ids, logprobs, tops, tm: TokenizerManager) -> dict[str, Any]:
    """OpenAI's chat logprobs; ``bytes`` are the token's own bytes, also where they are only
    part of a UTF-8 character (``token`` then shows the replacement character)."""

    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
        return {
            "token": tm.token_text(token_id),
            "logprob": logprob,
            "bytes": list(tm.token_bytes(token_id)),
        }

    content = []
    for token_id, logprob, top in zip(result_ids, logprobs, tops, strict=False):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in (top or [])]
        content.append(item)
    return {"content": content}


def _choice(
    index: int, result: SampleResult, want_logprobs: bool, tm: TokenizerManager, plan: ChatPlan
) -> dict[str, Any]:
    message, finish_reason = shape_message(plan, result.text, result.finish_reason)
    return {
        "index": index,
        "message": message,
        "logprobs": _logprobs(result.token_ids, result.logprobs, result.top_logprobs, tm)
        if want_logprobs
        else None,
        "finish_reason": finish_reason,
        "matched_stop": result.matched_stop,
    }


async def chat_completion(
    tm: TokenizerManager,
    body: ChatCompletionRequest,
    inp: GenerateRequest,
    plan: ChatPlan,
    handles: list[RequestHandle],
) -> dict[str, Any] | AsyncIterator[str]:
    model = body.model or tm.args.model_name
    if body.stream:
        return _stream(tm, body, inp, plan, handles, model)
    results = await collect(handles)
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [_choice(i, r, inp.return_logprob, tm, plan) for i, r in enumerate(results)],
        "usage": usage_dict(results, len(handles)),
    }


async def _stream(
    tm: TokenizerManager,
    body: ChatCompletionRequest,
    inp: GenerateRequest,
    plan: ChatPlan,
    handles: list[RequestHandle],
    model: str,
) -> AsyncIterator[str]:
    chunk_id, created = new_id("chatcmpl"), now()
    results = [SampleResult(prompt_tokens=len(inp.input_ids)) for _ in handles]
    shapers = [ChatOutputStream(plan) for _ in handles]
    every_chunk_usage = continuous_usage(body.stream_options)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        usage = results[index] if every_chunk_usage else None
        return stream_chunk((chunk_id, created, model), "chat.completion.chunk", choice, usage)

    outputs = await started(handles)  # nothing is sent before the first output
    for index in range(len(handles)):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, out in outputs:
        results[index].add(out)
        logprobs = (
            _logprobs(out.new_token_ids, out.new_logprobs, out.new_top_logprobs, tm)
            if inp.return_logprob and out.new_token_ids
            else None
        )
        delta = shapers[index].feed(out.text_delta)
        if delta or logprobs:
            yield chunk(index, delta or {"content": ""}, None, logprobs)
        if out.finish_reason is not None:
            last, finish = shapers[index].finish(out.finish_reason.type)
            if last:
                yield chunk(index, last)
            yield chunk(index, {}, finish)
    if body.stream_options and body.stream_options.include_usage:
        yield sse(
            {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage_dict(results, len(handles)),
            }
        )
    yield sse("[DONE]")
