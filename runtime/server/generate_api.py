"""SGLang's native ``POST /generate``: text or input_ids, single or batch, SSE streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvflow.runtime.server.bootstrap_fields import bootstraps_of
from kvflow.runtime.server.openai.common import SampleResult, collect, merge_streams, sse
from kvflow.runtime.server.openai.protocol import GenerateRequestBody
from kvflow.runtime.server.tokenizer_manager import GenerateInput, RequestHandle, TokenizerManager
from kvflow.runtime.wire import SamplingParams
from kvflow.runtime.wire.errors import RequestError

__all__ = ["native_generate", "prepare_native"]


def prepare_native(
    tm: TokenizerManager, body: GenerateRequestBody
) -> tuple[bool, list[GenerateInput]]:
    """Returns (single, inputs)."""
    if (body.text is None) == (body.input_ids is None):
        raise RequestError(400, "give exactly one of text and input_ids")
    if unsupported := body.unsupported_flags():
        raise RequestError(400, f"not supported by kvflow: {', '.join(unsupported)} (give false)")
    if body.text is not None:
        single = isinstance(body.text, str)
        texts = [body.text] if single else body.text
        ids_list = [tm.tokenize(t) for t in texts]  # type: ignore[union-attr]
    else:
        ids = body.input_ids or []
        single = not ids or isinstance(ids[0], int)
        ids_list = [list(ids)] if single else [list(i) for i in ids]  # type: ignore[arg-type]
    raw = body.sampling_params
    raw_list = raw if isinstance(raw, list) else [raw] * len(ids_list)
    if len(raw_list) != len(ids_list):
        raise RequestError(400, "give one sampling_params per prompt, or a single one")
    bootstraps = bootstraps_of(
        body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, len(ids_list)
    )
    inputs = []
    for ids, params, bootstrap in zip(ids_list, raw_list, bootstraps, strict=True):
        try:
            sampling = SamplingParams.from_dict(params)
        except ValueError as err:
            raise RequestError(400, str(err)) from err
        inputs.append(
            GenerateInput(
                ids,
                sampling,
                body.return_logprob,
                body.top_logprobs_num,
                body.extra_key,
                body.rid,
                body.stream,
                bootstrap,
            )
        )
    return single, inputs


def _meta(result: SampleResult, rid: str, with_logprobs: bool) -> dict[str, Any]:
    finish: dict[str, Any] | None = None
    if result.finish_reason is not None:
        finish = {"type": result.finish_reason}
        if result.matched_stop is not None:
            finish["matched"] = result.matched_stop
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
    }
    if with_logprobs:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(result.logprobs, result.token_ids, strict=False)
        ]
        meta["output_top_logprobs"] = [
            [[lp, t, None] for t, lp in (top or [])] for top in result.top_logprobs
        ]
    return meta


async def native_generate(
    single: bool, inputs: list[GenerateInput], handles: list[RequestHandle], stream: bool
) -> Any:
    with_logprobs = any(i.return_logprob for i in inputs)
    if stream:
        return _stream(handles, with_logprobs)
    results = await collect(handles)
    body = [
        {"text": r.text, "output_ids": r.token_ids, "meta_info": _meta(r, h.rid, with_logprobs)}
        for r, h in zip(results, handles, strict=True)
    ]
    return body[0] if single and len(body) == 1 else body


async def _stream(handles: list[RequestHandle], with_logprobs: bool) -> AsyncIterator[str]:
    """Each event carries the cumulative text and ids of one sample (``index``), as SGLang does."""
    results = [SampleResult() for _ in handles]
    async for index, out in merge_streams(handles):
        result = results[index]
        result.add(out)
        yield sse(
            {
                "index": index,
                "text": result.text,
                "output_ids": result.token_ids,
                "meta_info": _meta(result, handles[index].rid, with_logprobs),
            }
        )
    yield sse("[DONE]")
