"""SGLang's native ``POST /generate``: text or input_ids, single or batch, SSE streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvflow.runtime.server.bootstrap_fields import bootstraps_of
from kvflow.runtime.server.openai.common import SampleResult, collect, sse, started
from kvflow.runtime.server.openai.fields import check_sampling_fields
from kvflow.runtime.server.openai.protocol import GenerateRequestBody
from kvflow.runtime.server.tokenizer_manager import RequestHandle, TokenizerManager
from kvflow.runtime.wire import GenerateRequest, SamplingParams
from kvflow.runtime.wire.errors import RequestError
from kvflow.runtime.wire.sampling import SAMPLING_KEYS

__all__ = ["native_generate", "prepare_native"]


def prepare_native(
    tm: TokenizerManager, body: GenerateRequestBody
) -> tuple[bool, list[GenerateRequest]]:
    """Returns (single, inputs)."""
    if (body.text is None) == (body.input_ids is None):
        raise RequestError(400, "give exactly one of text and input_ids")
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
        body.bootstrap_host,
        body.bootstrap_port,
        body.bootstrap_room,
        len(ids_list),
        body.bootstrap_token,
    )
    adapters = (
        body.lora_path if isinstance(body.lora_path, list) else [body.lora_path] * len(ids_list)
    )
    if len(adapters) != len(ids_list):
        raise RequestError(400, "give one lora_path per prompt, or a single one")
    inputs = []
    for ids, params, bootstrap, adapter in zip(
        ids_list, raw_list, bootstraps, adapters, strict=True
    ):
        try:
            sampling = SamplingParams.from_dict(check_sampling_fields(params, SAMPLING_KEYS))
        except ValueError as err:
            raise RequestError(400, str(err)) from err
        inputs.append(
            GenerateRequest(
                input_ids=ids,
                sampling=sampling,
                rid=body.rid,
                stream=body.stream,
                return_logprob=body.return_logprob,
                top_logprobs_num=body.top_logprobs_num,
                logprob_start_len=body.logprob_start_len,
                extra_key=body.cache_namespace,
                lora_path=adapter,
                bootstrap=bootstrap,
            )
        )
    return single, inputs


def _meta(
    result: SampleResult, rid: str, logprobs: _LogprobView | None, inp: GenerateRequest
) -> dict[str, Any]:
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
    if logprobs is not None:
        entry = logprobs.entry
        meta["output_token_logprobs"] = [
            entry(lp, t) for lp, t in zip(result.logprobs, result.token_ids, strict=False)
        ]
        meta["output_top_logprobs"] = [
            [entry(lp, t) for t, lp in (top or [])] for top in result.top_logprobs
        ]
        if result.input_logprobs is not None:
            # a PD prefill answers [] (its decode answers the prompt's logprobs)
            scored = inp.input_ids[inp.logprob_start_len :] if result.input_logprobs else []
            meta["input_token_logprobs"] = [
                entry(lp, t) for lp, t in zip(result.input_logprobs, scored, strict=True)
            ]
            meta["input_top_logprobs"] = [
                [entry(lp, t) for t, lp in (top or [])] for top in result.input_top_logprobs or []
            ]
    return meta


class _LogprobView:
    """SGLang's logprob entries ``[logprob, token_id, text]``; text only with
    ``return_text_in_logprobs`` (else ``None``, as SGLang does)."""

    def __init__(self, tm: TokenizerManager, with_text: bool) -> None:
        self._token_text = tm.token_text if with_text else None

    def entry(self, logprob: float | None, token_id: int) -> list[Any]:
        text = self._token_text(token_id) if self._token_text is not None else None
        return [logprob, token_id, text]


async def native_generate(
    tm: TokenizerManager,
    body: GenerateRequestBody,
    single: bool,
    inputs: list[GenerateRequest],
    handles: list[RequestHandle],
) -> Any:
    view = (
        _LogprobView(tm, body.return_text_in_logprobs)
        if any(i.return_logprob for i in inputs)
        else None
    )
    if body.stream:
        return _stream(handles, view, _inputs_per_sample(inputs))
    results = await collect(handles)
    per_sample = _inputs_per_sample(inputs)
    out = [
        {"text": r.text, "output_ids": r.token_ids, "meta_info": _meta(r, h.rid, view, i)}
        for r, h, i in zip(results, handles, per_sample, strict=True)
    ]
    return out[0] if single and len(out) == 1 else out


def _inputs_per_sample(inputs: list[GenerateRequest]) -> list[GenerateRequest]:
    """The prompt of each sample (``n`` samples per prompt, in order)."""
    return [inp for inp in inputs for _ in range(inp.sampling.n)]


async def _stream(
    handles: list[RequestHandle], view: _LogprobView | None, per_sample: list[GenerateRequest]
) -> AsyncIterator[str]:
    """Each event carries the cumulative text and ids of one sample (``index``), as SGLang does."""
    results = [SampleResult() for _ in handles]
    async for index, out in await started(handles):  # nothing is sent before the first output
        result = results[index]
        result.add(out)
        yield sse(
            {
                "index": index,
                "text": result.text,
                "output_ids": result.token_ids,
                "meta_info": _meta(result, handles[index].rid, view, per_sample[index]),
            }
        )
    yield sse("[DONE]")
