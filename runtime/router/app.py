"""The router's HTTP surface (aiohttp): proxied model routes, health, metrics, worker admin."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvflow import contract
from kvflow.runtime.router.discovery import WorkerSpec
from kvflow.runtime.router.health import health_error, probe_pair
from kvflow.runtime.router.prompt import parse_body
from kvflow.runtime.router.proxy import REQUEST_ID, Forwarder
from kvflow.runtime.router.upstream import abort_on, credential_of
from kvflow.runtime.router.worker import Worker
from kvflow.runtime.wire import RequestError, error_body

__all__ = ["FORWARDER", "create_admin_app", "create_app"]

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


def _is_admin(request: web.Request) -> bool:
    """The admin routes that change the worker set (``POST /workers``,
    ``DELETE /workers/{url}``); reading the list goes by the API key like the model routes."""
    path = request.path
    return request.method != "GET" and (path == "/workers" or path.startswith("/workers/"))


def _loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def _admin_refusal(request: web.Request, admin_key: str | None, api_key: str | None) -> str | None:
    """Why an admin route (see :func:`_is_admin`) is refused: with the internal key it is the only
    credential that passes (clients hold the API key, not it); with only an API key, that
    key; with neither, only loopback clients may use them."""
    key = admin_key or api_key
    if key is None:
        if _loopback(request.remote):
            return None
        return (
            "the admin routes answer only on loopback when no key is set "
            f"(set ${contract.INTERNAL_KEY_ENV} or ${contract.API_KEY_ENV})"
        )
    given = request.headers.get("Authorization", "").encode()
    if hmac.compare_digest(given, f"Bearer {key}".encode()):
        return None
    which = "the internal key" if admin_key else "the API key"
    return f"missing or wrong {which} for the admin routes (Authorization: Bearer <key>)"


def _guard(api_key: str | None, admin_key: str | None = None) -> Any:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Request id, API key (every path but /health and /metrics; the admin routes have
        their own rule), RequestError -> JSON."""
        rid = request.headers.get(REQUEST_ID) or _new_request_id()
        request[REQUEST_ID] = rid
        if _is_admin(request):
            refusal = _admin_refusal(request, admin_key, api_key)
            if refusal is not None:
                log.info("rid=%s %s refused: %s", rid, request.path, refusal)
                status = 403 if admin_key is None and api_key is None else 401
                return _error(status, refusal, {REQUEST_ID: rid})
        elif expected is not None and request.path not in _OPEN_PATHS:
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
    forwarder = request.app[FORWARDER]
    registry = forwarder.registry
    new = registry.get(spec.url) is None
    registry.upsert(spec)
    worker = registry.get(spec.url)
    assert worker is not None
    if new:  # healthy only once it answers: a worker on a dead port takes no traffic
        await _first_check(forwarder, worker)
    return web.json_response(worker.describe(), status=201)


async def _first_check(forwarder: Forwarder, worker: Worker) -> None:
    """One ``GET /health`` of a worker the admin API just added; failing, it starts
    unhealthy (the health checker brings it back when it answers)."""
    timeout = aiohttp.ClientTimeout(total=forwarder.config.health.timeout_s)
    error = await health_error(forwarder.session, worker, timeout)
    if error:
        worker.healthy = False
        worker.last_error = error
        forwarder.registry.metrics.healthy.labels(worker.url).set(0)


async def _remove_worker(request: web.Request) -> web.Response:
    _refuse_when_discovering(request)
    url = unquote(request.match_info["url"]).rstrip("/")
    registry = request.app[FORWARDER].registry
    if registry.get(url) is None:
        raise RequestError(404, f"no worker {url!r}")
    registry.remove(url)
    return web.json_response({"removed": url})


def _app(forwarder: Forwarder, api_key: str | None) -> web.Application:
    guard = _guard(api_key, forwarder.config.internal_key)
    app = web.Application(middlewares=[guard], client_max_size=256 * 1024**2)
    app[FORWARDER] = forwarder
    return app


def _add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/workers", _list_workers)
    app.router.add_post("/workers", _add_worker)
    app.router.add_delete("/workers/{url:.+}", _remove_worker)


def create_admin_app(forwarder: Forwarder, api_key: str | None) -> web.Application:
    """The admin routes alone (``--admin-port``), under the same credential rule."""
    app = _app(forwarder, api_key)
    _add_admin_routes(app)
    return app


def create_app(forwarder: Forwarder, api_key: str | None) -> web.Application:
    """The router's aiohttp application over ``forwarder`` (which holds every piece of
    state); the admin routes are on it unless the router has an admin port."""
    app = _app(forwarder, api_key)
    for route, pairable in _MODEL_ROUTES.items():
        app.router.add_post(route, _proxy(route, pairable))
    app.router.add_get("/v1/models", _proxy("/v1/models", False))
    app.router.add_get(contract.HEALTH_GENERATE_PATH, _health_generate)
    app.router.add_post("/abort_request", _abort_request)
    app.router.add_get(contract.HEALTH_PATH, _health)
    app.router.add_get(contract.ROUTER_READINESS_PATH, _readiness)
    app.router.add_get(contract.METRICS_PATH, _metrics)
    if forwarder.config.admin_port is None:
        _add_admin_routes(app)
    return app
