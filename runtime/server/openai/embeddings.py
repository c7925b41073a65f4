"""``POST /v1/embeddings`` (OpenAI's shapes) and SGLang's native ``/encode``.

Each input is one prefill-only request (``GenerateRequest.embed``) that the scheduler
batches with the others; it answers the prompt's pooled, L2-normalised hidden state
(:mod:`kvflow.runtime.pooling`). Only an ``--is-embedding`` server takes them.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from kvflow.runtime.server.openai.common import merge_streams
from kvflow.runtime.server.openai.protocol import EmbeddingRequest, EncodeRequestBody
from kvflow.runtime.server.tokenizer_manager import RequestHandle, TokenizerManager
from kvflow.runtime.wire import GenerateRequest, SamplingParams
from kvflow.runtime.wire.errors import RequestError
from kvflow.runtime.wire.messages import TextOutput

__all__ = ["embedding_response", "encode_response", "prepare_embeddings", "prepare_encode"]

_EMBED = SamplingParams().prefill_only()


def _ids_of(tm: TokenizerManager, prompt: Any) -> list[list[int]]:
    """Token ids of each input: a string, strings, token ids or lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise RequestError(400, "the input is empty")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    ids_list = []
    for index, item in enumerate(prompt):
        if isinstance(item, str) and not item.strip():
            raise RequestError(400, f"input {index} is empty or whitespace only")
        ids_list.append(tm.tokenize(item) if isinstance(item, str) else list(item))
    return ids_list


def _requests(ids_list: list[list[int]], rid: str | None = None) -> list[GenerateRequest]:
    if rid is not None and len(ids_list) > 1:
        raise RequestError(400, "rid can only name a single prompt")
    return [
        GenerateRequest(input_ids=ids, sampling=_EMBED, rid=rid, embed=True) for ids in ids_list
    ]


def prepare_embeddings(tm: TokenizerManager, body: EmbeddingRequest) -> list[GenerateRequest]:
    if body.dimensions is not None:
        raise RequestError(
            400, "'dimensions' is not supported by kvflow (no Matryoshka truncation); leave it out"
        )
    return _requests(_ids_of(tm, body.input))


def prepare_encode(tm: TokenizerManager, body: EncodeRequestBody) -> list[GenerateRequest]:
    if (body.text is None) == (body.input_ids is None):
        raise RequestError(400, "give exactly one of 'text' and 'input_ids'")
    return _requests(_ids_of(tm, body.text if body.text is not None else body.input_ids), body.rid)


async def _finished(handles: list[RequestHandle]) -> list[TextOutput]:
    """Each request's last output (the one with its embedding), in order."""
    last: dict[int, TextOutput] = {}
    async for index, out in merge_streams(handles):  # an aborted request raises its error
        last[index] = out
    return [last[i] for i in range(len(handles))]


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    # OpenAI's base64: contiguous little-endian float32 values
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


async def embedding_response(
    tm: TokenizerManager, body: EmbeddingRequest, handles: list[RequestHandle]
) -> dict[str, Any]:
    outputs = await _finished(handles)
    prompt_tokens = sum(out.prompt_tokens for out in outputs)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(out.embedding or [], body.encoding_format),
            }
            for index, out in enumerate(outputs)
        ],
        "model": tm.args.model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


async def encode_response(
    body: EncodeRequestBody, handles: list[RequestHandle]
) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's shape: ``{"embedding", "meta_info"}``, a list of them for a batch."""
    outputs = await _finished(handles)
    answers = [
        {
            "embedding": out.embedding or [],
            "meta_info": {
                "id": out.rid,
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": out.prompt_tokens,
                "cached_tokens": out.cached_tokens,
            },
        }
        for out in outputs
    ]
    single = isinstance(body.text, str) or (
        body.input_ids is not None and bool(body.input_ids) and isinstance(body.input_ids[0], int)
    )
    return answers[0] if single else answers
