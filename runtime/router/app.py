"""The router's HTTP surface (aiohttp): proxied model routes, health, metrics, worker admin."""

from __future__ import annotations

import hmac
import json
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvflow import contract
from kvflow.runtime.router.discovery import WorkerSpec
from kvflow.runtime.router.health import probe_pair
from kvflow.runtime.router.prompt import parse_body
from kvflow.runtime.router.proxy import REQUEST_ID, Forwarder
from kvflow.runtime.router.upstream import abort_on, credential_of
from kvflow.runtime.wire import RequestError, error_body

__all__ = ["FORWARDER", "create_app"]

log = logging.getLogger("kvflow.router")

FORWARDER: web.AppKey[Forwarder] = web.AppKey("forwarder", Forwarder)
_OPEN_PATHS = frozenset(
    {contract.HEALTH_PATH, contract.ROUTER_READINESS_PATH, contract.METRICS_PATH}
)
# route -> may go through PD pairing (a generation request, rather than a GET)
_MODEL_ROUTES = {"/v1/chat/completions": True, "/v1/completions": True, "/generate": True}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message), status=status, headers=headers)


def _new_request_id() -> str:
    """32 hex digits, like a uuid4's: an identifier, not a secret (no urandom syscall)."""
    return f"{random.getrandbits(128):032x}"


def _guard(api_key: str | None) -> Any:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Request id, API key (every path but /health and /metrics), RequestError -> JSON."""
        rid = request.headers.get(REQUEST_ID) or _new_request_id()
        request[REQUEST_ID] = rid
        if expected is not None and request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                log.info("rid=%s %s refused: missing or wrong API key", rid, request.path)
                return _error(
                    401, "missing or wrong API key (Authorization: Bearer <key>)", {REQUEST_ID: rid}
                )
        try:
            return await handler(request)
        except RequestError as err:
            log.info("rid=%s %s -> %d: %s", rid, request.path, err.status, err.message)
            return _error(err.status, err.message, {**err.headers, REQUEST_ID: rid})

    return guard


def _proxy(route: str, pairable: bool) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await request.app[FORWARDER].forward(request, route, pairable)

    return handle


async def _health_generate(request: web.Request) -> web.StreamResponse:
    """Forwarded to one worker; in PD mode 200 only when a prefill and a decode each pass
    their own (a pair's health, not one half's)."""
    forwarder = request.app[FORWARDER]
    if not forwarder.registry.has_pd():
        return await forwarder.forward(request, contract.HEALTH_GENERATE_PATH, False)
    headers = {h: request.headers[h] for h in ("Authorization",) if h in request.headers}
    headers[REQUEST_ID] = request[REQUEST_ID]
    problem = await probe_pair(forwarder.session, forwarder.registry, headers)
    if problem:
        raise RequestError(503, problem)
    return web.json_response({"status": "ok"})


async def _abort_request(request: web.Request) -> web.Response:
    """SGLang's ``{"rid": ...}``, forwarded to the worker(s) running that rid when it came
    through this router from the same credential; any other rid gets the workers' 404.
    The workers check the credential again (the client's ``Authorization`` goes along)."""
    forwarder = request.app[FORWARDER]
    body = await request.read()
    payload = parse_body(body)
    if payload.get("abort_all"):
        raise RequestError(400, "abort_all is not supported: abort each request by its rid")
    rid = payload.get("rid")
    if not isinstance(rid, str) or not rid:
        raise RequestError(400, "abort_request needs a string 'rid'")
    owned = forwarder.rids.get(rid)
    credential = credential_of(request, forwarder.config.api_key)
    if owned is None or owned.plan is None or not hmac.compare_digest(owned.credential, credential):
        raise RequestError(404, f"no request {rid!r} of this credential is in flight")
    headers = {h: request.headers[h] for h in ("Authorization",) if h in request.headers}
    headers.update({"Content-Type": "application/json", REQUEST_ID: request[REQUEST_ID]})
    answer = await abort_on(forwarder.session, owned.plan, body, headers)
    headers = {"Content-Type": answer.content_type, REQUEST_ID: request[REQUEST_ID]}
    return web.Response(status=answer.status, body=answer.body, headers=headers)


async def _health(request: web.Request) -> web.Response:
    registry = request.app[FORWARDER].registry
    workers = registry.all()
    return web.json_response(
        {"status": "ok", "workers": len(workers), "available": sum(w.available for w in workers)}
    )


async def _readiness(request: web.Request) -> web.Response:
    """200 while a worker of every role the router needs is available (see the contract)."""
    registry = request.app[FORWARDER].registry
    roles = ("prefill", "decode") if registry.has_pd() else ("unified",)
    available = {role: len(registry.available(role)) for role in roles}
    missing = [registry.why_none(role) for role, count in available.items() if not count]
    if missing:
        return _error(503, "not ready: " + "; ".join(missing))
    return web.json_response({"status": "ready", "available": available})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[FORWARDER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _list_workers(request: web.Request) -> web.Response:
    forwarder = request.app[FORWARDER]
    return web.json_response(
        {
            "workers": [w.describe() for w in forwarder.registry.all()],
            "admission": {
                "active": forwarder.admission.active,
                "queued": forwarder.admission.queued,
            },
        }
    )


def _refuse_when_discovering(request: web.Request) -> None:
    if request.app[FORWARDER].config.discovers:
        raise RequestError(
            409, "workers are discovered from Kubernetes; the admin API is for static mode"
        )


async def _add_worker(request: web.Request) -> web.Response:
    _refuse_when_discovering(request)
    try:
        payload = json.loads(await request.read())
        spec = WorkerSpec(
            url=str(payload["url"]).rstrip("/"),
            role=payload.get("role", "unified"),
            bootstrap_port=payload.get("bootstrap_port"),
        )
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as err:
        raise RequestError(400, f'expected {{"url", "role"?, "bootstrap_port"?}}: {err}') from err
    registry = request.app[FORWARDER].registry
    registry.upsert(spec)
    worker = registry.get(spec.url)
    assert worker is not None
    return web.json_response(worker.describe(), status=201)


async def _remove_worker(request: web.Request) -> web.Response:
    _refuse_when_discovering(request)
    url = unquote(request.match_info["url"]).rstrip("/")
    registry = request.app[FORWARDER].registry
    if registry.get(url) is None:
        raise RequestError(404, f"no worker {url!r}")
    registry.remove(url)
    return web.json_response({"removed": url})


def create_app(forwarder: Forwarder, api_key: str | None) -> web.Application:
    """The router's aiohttp application over ``forwarder`` (which holds every piece of state)."""
    app = web.Application(middlewares=[_guard(api_key)], client_max_size=256 * 1024**2)
    app[FORWARDER] = forwarder
    for route, pairable in _MODEL_ROUTES.items():
        app.router.add_post(route, _proxy(route, pairable))
    app.router.add_get("/v1/models", _proxy("/v1/models", False))
    app.router.add_get(contract.HEALTH_GENERATE_PATH, _health_generate)
    app.router.add_post("/abort_request", _abort_request)
    app.router.add_get(contract.HEALTH_PATH, _health)
    app.router.add_get(contract.ROUTER_READINESS_PATH, _readiness)
    app.router.add_get(contract.METRICS_PATH, _metrics)
    app.router.add_get("/workers", _list_workers)
    app.router.add_post("/workers", _add_worker)
    app.router.add_delete("/workers/{url:.+}", _remove_worker)
    return app
