"""The FastAPI app: native and OpenAI-compatible routes over one TokenizerManager."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kvflow import contract
from kvflow.runtime.server.generate_api import native_generate, prepare_native
from kvflow.runtime.server.lora_api import adapter_cards, add_lora_routes
from kvflow.runtime.server.openai.chat import chat_completion, prepare_chat
from kvflow.runtime.server.openai.common import sse
from kvflow.runtime.server.openai.completions import completion, prepare_completion
from kvflow.runtime.server.openai.embeddings import (
    embedding_response,
    encode_response,
    prepare_embeddings,
    prepare_encode,
)
from kvflow.runtime.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    EncodeRequestBody,
    GenerateRequestBody,
)
from kvflow.runtime.server.tokenizer_manager import (
    INTERNAL_OWNER,
    RequestHandle,
    TokenizerManager,
)
from kvflow.runtime.wire import GenerateRequest, RequestError, SamplingParams, error_body

__all__ = ["create_app"]
logger = logging.getLogger("kvflow.http")

_OPEN_PATHS = {contract.HEALTH_PATH, contract.HEALTH_GENERATE_PATH, contract.METRICS_PATH}
_DISCONNECT_POLL_S = 0.5
_HEALTH_GENERATE_TIMEOUT_S = 60.0


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


async def _respond(
    request: Request, handles: list[RequestHandle], body: Awaitable[Any]
) -> Response:
    """Await the response body; abort its samples if the client disconnects meanwhile.

    A streaming body is answered once its first chunk exists (a stream sends nothing
    before its first output), so a failure before that is an HTTP error status a router
    can retry rather than a 200 with an error event; the stream's own clean-up aborts
    unfinished samples when the client goes away mid-stream.
    """
    task = asyncio.ensure_future(_primed(body))
    try:
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                _cancel(handles)
                return Response(status_code=499)
        result = task.result()
    except BaseException:
        _cancel(handles)
        raise
    if isinstance(result, _Primed):
        return StreamingResponse(_guarded(result.chunks()), media_type="text/event-stream")
    _cancel(handles)
    return JSONResponse(result)


class _Primed:
    """A stream whose first chunk was already drawn."""

    def __init__(self, first: str | None, rest: AsyncIterator[str]) -> None:
        self.first, self.rest = first, rest

    async def chunks(self) -> AsyncIterator[str]:
        try:
            if self.first is None:
                return
            yield self.first
            async for chunk in self.rest:
                yield chunk
        finally:  # ended early (client gone): the stream's clean-up aborts its samples now
            close = getattr(self.rest, "aclose", None)
            if close is not None:
                await close()


async def _primed(body: Awaitable[Any]) -> Any:
    """The body; a stream as :class:`_Primed`, once its first chunk exists."""
    result = await body
    if not isinstance(result, AsyncIterator):
        return result
    try:
        first = await anext(result)
    except StopAsyncIteration:
        first = None
    return _Primed(first, result)


async def _guarded(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once streaming has begun the status is sent: report failures as an error event."""
    try:
        async for chunk in stream:
            yield chunk
    except RequestError as err:
        yield sse(error_body(err.status, err.message))
        yield sse("[DONE]")


class _ApiKeyGuard:
    """ASGI middleware: every path but the open ones needs ``Authorization: Bearer <key>``
    (401 otherwise). Plain ASGI rather than an ``@app.middleware("http")`` function, which
    would relay every chunk of a streamed response through an extra task and queue."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if given != self.expected:
                refusal = _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _cancel(handles: list[RequestHandle]) -> None:
    for handle in handles:
        handle.cancel()


def credential_of(request: Request, api_key: str | None) -> str:
    """Who may abort the requests ``request`` starts: a hash of its bearer token (never the
    token itself) when the server has an API key, else ``anonymous``, the one credential
    every client of a server without a key shares."""
    if not api_key:
        return "anonymous"
    token = request.headers.get("authorization", "").encode()
    return "bearer:" + hashlib.sha256(token).hexdigest()


def create_app(tm: TokenizerManager) -> FastAPI:
    app = FastAPI(title="kvflow", version="0.1.0")
    api_key = tm.args.api_key

    if api_key:
        app.add_middleware(_ApiKeyGuard, api_key=api_key)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, err: RequestError) -> JSONResponse:
        return _error(err.status, err.message, err.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, err: Exception) -> JSONResponse:
        # A bug, not the client's fault: still OpenAI's shape, and the server keeps serving.
        logger.exception("unhandled error in a request handler")
        return _error(500, f"internal error: {type(err).__name__}")

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, err: HTTPException) -> JSONResponse:
        # Unknown routes (404), wrong methods (405): OpenAI's error shape, not {"detail"}.
        return _error(err.status_code, str(err.detail), dict(err.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in err.errors()
        )
        return _error(400, f"invalid request: {problems}")

    @app.get(contract.HEALTH_PATH)
    async def health() -> Response:
        if tm.dead_reason:
            return _error(503, f"unhealthy: {tm.dead_reason}")
        return JSONResponse({"status": "draining" if tm.draining else "ok"})

    @app.get(contract.HEALTH_GENERATE_PATH)
    async def health_generate() -> Response:
        """One token through the model, on every role: a probe skips the role's queues (no
        bootstrap room, nothing transferred). The prefill prefills a one-token prompt; the
        unified and decode roles also run one decode step after it."""
        role = tm.info.get("role", "unified")
        sampling = SamplingParams(
            max_new_tokens=1 if role == "prefill" else 2, temperature=0, ignore_eos=True
        )
        if tm.is_embedding:  # an embedding server's probe embeds a one-token prompt
            sampling = sampling.prefill_only()
        probe = GenerateRequest(input_ids=[0], sampling=sampling, probe=True, embed=tm.is_embedding)
        handles = await tm.generate([probe], INTERNAL_OWNER)
        try:
            async with asyncio.timeout(_HEALTH_GENERATE_TIMEOUT_S):
                async for _ in handles[0]:
                    pass
        except TimeoutError:
            return _error(503, "the model did not produce a token in time")
        except RequestError as err:
            return _error(503, f"the health probe failed: {err.message}")
        finally:
            handles[0].cancel()
        return JSONResponse({"status": "ok", "role": role})

    @app.get(contract.METRICS_PATH)
    async def metrics() -> Response:
        return Response(generate_latest(tm.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": tm.args.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvflow",
            "max_model_len": tm.context_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(), *adapter_cards(tm)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        adapter = next((c for c in adapter_cards(tm) if c["id"] == model_id), None)
        if adapter is not None:
            return JSONResponse(adapter)
        if model_id != tm.args.model_name:
            return _error(
                404,
                f"the model {model_id!r} does not exist; this server serves {tm.args.model_name!r}",
            )
        return JSONResponse(model_card())

    add_lora_routes(app, tm)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        tm.check_accepting()
        inp, plan = prepare_chat(tm, body)
        handles = await tm.generate([inp], credential_of(request, api_key))
        return await _respond(request, handles, chat_completion(tm, body, inp, plan, handles))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tm.check_accepting()
        inputs, texts = prepare_completion(tm, body)
        handles = await tm.generate(inputs, credential_of(request, api_key))
        return await _respond(request, handles, completion(tm, body, inputs, texts, handles))

    @app.post("/generate")
    async def generate(body: GenerateRequestBody, request: Request) -> Response:
        tm.check_accepting()
        single, inputs = prepare_native(tm, body)
        handles = await tm.generate(inputs, credential_of(request, api_key))
        return await _respond(request, handles, native_generate(tm, body, single, inputs, handles))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        tm.check_accepting()
        inputs = prepare_embeddings(tm, body)
        handles = await tm.generate(inputs, credential_of(request, api_key))
        return await _respond(request, handles, embedding_response(tm, body, handles))

    @app.api_route("/encode", methods=["POST", "PUT"])
    async def encode(body: EncodeRequestBody, request: Request) -> Response:
        tm.check_accepting()
        inputs = prepare_encode(tm, body)
        handles = await tm.generate(inputs, credential_of(request, api_key))
        return await _respond(request, handles, encode_response(body, handles))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        """SGLang's body ``{"rid": ...}``; only the credential that started ``rid`` may
        abort it. Another's rid and an unknown one get the same 404."""
        payload = await _json_object(request)
        if payload.get("abort_all"):
            raise RequestError(400, "abort_all is not supported: abort each request by its rid")
        rid = payload.get("rid")
        if not isinstance(rid, str) or not rid:
            raise RequestError(400, "abort_request needs a string 'rid'")
        if not tm.abort_owned(rid, credential_of(request, api_key)):
            raise RequestError(404, f"no request {rid!r} of this credential is in flight")
        return JSONResponse({"rid": rid, "found": True})

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        reply = await tm.control("flush_cache")
        if not reply.ok:
            return _error(409, "cannot flush the cache while requests are in flight")
        return JSONResponse({"flushed": True})

    @app.get("/get_model_info")
    @app.get("/model_info")  # SGLang's newer name; sglang-router asks for it first
    async def model_info() -> dict[str, Any]:
        """SGLang's shape: a router reads the model path from it when it registers a worker."""
        return {
            "model_path": tm.info.get("model_path"),
            "tokenizer_path": tm.info.get("tokenizer_path"),
            "is_generation": not tm.is_embedding,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    @app.get("/get_server_info")
    @app.get("/server_info")  # SGLang's newer name; sglang-router asks for it first
    async def server_info() -> dict[str, Any]:
        reply = await tm.control("get_stats")
        stats = reply.payload["stats"]
        return {
            "model_name": tm.args.model_name,
            "engine": _jsonable(vars(tm.args.engine)),
            **tm.info,
            "in_flight_requests": tm.num_in_flight,
            "stats": {
                **vars(stats),
                "token_usage": stats.token_usage,
                "spec_accept_length": stats.spec_accept_length,
            },
            # SGLang's place for it (its bench_serving reads it from here)
            "internal_states": [{"avg_spec_accept_length": stats.spec_accept_length}],
            # one entry per data-parallel group (--dp-size), in group order
            "dp_stats": [vars(s) for s in reply.payload["stats_per_group"]],
        }

    return app


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        payload = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as err:
        raise RequestError(400, f"malformed JSON: {err}") from err
    if not isinstance(payload, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return payload


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)
        for k, v in values.items()
    }
