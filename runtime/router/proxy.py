"""Forwarding one client request: choose, send, retry before the first byte, relay.

::

    admission slot -> [parse body if a policy or PD needs it] -> loop:
        plan (policy over available workers not yet tried) -> open_attempt
        connect error / 5xx  -> breaker failure, backoff, next worker (budget permitting)
        anything else        -> relay: JSON read whole, SSE passed chunk by chunk

Once relaying began the status is sent: an upstream break mid-stream becomes an SSE error
event and ``[DONE]``. The upstream connection is closed whenever the relay ends early
(client gone, timeout), so the worker aborts the request and frees its KV memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from kvflow.runtime.router import logs
from kvflow.runtime.router.adapter_request import adapter_key, requested_adapters
from kvflow.runtime.router.adapter_sync import AdapterSync
from kvflow.runtime.router.admission import Admission
from kvflow.runtime.router.backoff import RetryBudget
from kvflow.runtime.router.config import RouterConfig
from kvflow.runtime.router.metrics import RouterMetrics
from kvflow.runtime.router.pd import least_loaded, pd_body
from kvflow.runtime.router.policies import Policy
from kvflow.runtime.router.prompt import parse_body, routing_key
from kvflow.runtime.router.registry import WorkerRegistry
from kvflow.runtime.router.upstream import (
    Opened,
    OwnedRid,
    Plan,
    UpstreamFailure,
    credential_of,
    open_attempt,
)
from kvflow.runtime.router.worker import Worker
from kvflow.runtime.wire import RequestError, error_body

__all__ = ["REQUEST_ID", "Forwarder"]

log = logging.getLogger("kvflow.router")

REQUEST_ID = "X-Request-Id"
_PASS_HEADERS = ("Authorization", "Content-Type", "Accept", "Accept-Encoding")
_ANSWER_HEADERS = ("Content-Type", "Content-Encoding", "Retry-After", "Location")


_OWNED_RID = "kvflow.owned_rid"  # the request's OwnedRid, when its body names a rid


def _sse_error(message: str, status: int = 502) -> bytes:
    event = error_body(status, message)
    return b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"


class Forwarder:
    """Everything a request needs on its way through; one per router process."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        policy: Policy,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        adapters: AdapterSync | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.session = session
        self.adapters = adapters or AdapterSync(session, metrics, config.api_key)
        self.admission = Admission(config.admission, metrics)
        self.rids: dict[str, OwnedRid] = {}  # client-chosen rids in flight through here
        registry.on_remove(policy.forget)
        registry.on_remove(self.adapters.forget)

    async def forward(self, request: web.Request, route: str, pairable: bool) -> web.StreamResponse:
        """Answer ``request`` from a worker; ``pairable`` routes may go through PD pairing."""
        await self.admission.acquire()
        rid = None
        try:
            body = await request.read() if request.can_read_body else None
            if pairable and body is not None and b'"rid"' in body:
                rid = self._own_rid(request, body)
            return await self._forward(request, route, body, pairable)
        finally:
            self.admission.release()
            if rid is not None:
                del self.rids[rid]

    def _own_rid(self, request: web.Request, body: bytes) -> str | None:
        """Record the body's ``rid`` (a string) as this client's; a rid already in flight
        here is refused with the worker's 400."""
        rid = parse_body(body).get("rid")
        if not isinstance(rid, str) or not rid:
            return None
        if rid in self.rids:
            raise RequestError(400, f"a request with rid {rid!r} is already in flight")
        owned = self.rids[rid] = OwnedRid(credential_of(request, self.config.api_key))
        request[_OWNED_RID] = owned
        return rid

    def _candidates(self, role: str, exclude: frozenset[str], adapters: frozenset[str]) -> list:
        """Available workers of ``role`` not yet tried, that have ``adapters`` loaded."""
        found = self.registry.available(role, exclude)
        return [w for w in found if w.has_adapters(adapters)] if adapters else found

    def _plan(
        self,
        route: str,
        body: bytes | None,
        payload: dict | None,
        key: str,
        tried: set[str],
        adapters: frozenset[str] = frozenset(),
    ) -> Plan | None:
        """The next attempt's workers, or ``None`` when every candidate was tried."""
        exclude = frozenset(tried)
        if payload is not None and self.registry.has_pd():
            prefills = self._candidates("prefill", exclude, adapters)
            decodes = self._candidates("decode", exclude, adapters)
            if not prefills or not decodes:
                if tried:
                    return None
                cause = self.registry.why_none("prefill" if not prefills else "decode")
                raise RequestError(503, cause)
            prefill = self._select(prefills, key)
            decode = least_loaded(decodes)
            data = pd_body(
                route, payload, prefill, self.config.bootstrap_port, self.config.internal_key
            )
            return Plan(decode, data, prefill)
        role = self.registry.main_role()
        candidates = self._candidates(role, exclude, adapters)
        if not candidates:
            if tried:
                return None
            raise RequestError(503, self.registry.why_none(role))
        return Plan(self._select(candidates, key), body)

    def _select(self, candidates: list, key: str):  # type: ignore[no-untyped-def]
        selection = self.policy.select(candidates, key)
        if selection.match_ratio is not None:
            self.metrics.match_ratio.observe(selection.match_ratio)
        # a half-open breaker hands out one probe at a time: take it now
        selection.worker.breaker.allows()
        return selection.worker

    async def _forward(
        self, request: web.Request, route: str, body: bytes | None, pairable: bool
    ) -> web.StreamResponse:
        payload: dict | None = None
        key = ""
        adapters: frozenset[str] = frozenset()
        lora = self.registry.manages_adapters()
        if (
            body is not None
            and pairable
            and (self.policy.needs_key or self.registry.has_pd() or lora)
        ):
            payload = parse_body(body)
            key = routing_key(route, payload)
            if lora:
                adapters = requested_adapters(route, payload, self.registry.adapter_names())
                key = adapter_key(adapters, key)
        timeout_s = self.config.admission.request_timeout_s
        try:
            # one deadline for the whole request: attempts, backoff and the relay
            async with asyncio.timeout(timeout_s) as deadline:
                if adapters:
                    await self.adapters.ready(self.registry, adapters)
                return await self._attempts(request, route, body, payload, key, deadline, adapters)
        except TimeoutError:
            raise RequestError(504, f"request timeout ({timeout_s:g}s)") from None

    async def _attempts(
        self,
        request: web.Request,
        route: str,
        body: bytes | None,
        payload: dict | None,
        key: str,
        deadline: asyncio.Timeout,
        adapters: frozenset[str] = frozenset(),
    ) -> web.StreamResponse:
        rid = request[REQUEST_ID]
        given = request.headers
        headers = {h: given[h] for h in _PASS_HEADERS if h in given}
        headers[REQUEST_ID] = rid
        budget = RetryBudget(self.config.retry)
        tried: set[str] = set()
        last: UpstreamFailure | None = None
        owned: OwnedRid | None = request.get(_OWNED_RID)
        while (plan := self._plan(route, body, payload, key, tried, adapters)) is not None:
            if owned is not None:
                owned.plan = plan
            plan.worker.begin()
            try:
                opened = await open_attempt(
                    self.session, request.method, request.path, plan, headers
                )
                if opened.response.status >= 500:
                    raise await _status_failure(plan, opened)
                return await self._relay(request, route, plan, opened, deadline, len(tried))
            except UpstreamFailure as failure:
                last = failure
                self.metrics.count(route, failure.worker.url, failure.status)
                if not failure.retryable:
                    return _failure_response(failure, rid)
                failure.worker.breaker.record_failure()
                failure.worker.last_error = failure.message
                # PD: only the worker blamed is left out; its partner may serve the retry
                tried.add(failure.worker.url)
                log.warning("rid=%s %s: %s; retrying elsewhere", rid, route, failure.message)
                delay = budget.next_delay()
                if delay is None:
                    break
                self.metrics.retries.labels(route).inc()
                await asyncio.sleep(delay)
            finally:
                plan.worker.end()
        assert last is not None
        log.warning("rid=%s %s failed after %d attempts: %s", rid, route, len(tried), last.message)
        return _failure_response(last, rid, attempts=len(tried))

    async def _relay(
        self,
        request: web.Request,
        route: str,
        plan: Plan,
        opened: Opened,
        deadline: asyncio.Timeout,
        retries: int,
    ) -> web.StreamResponse:
        """Answer with the opened response. Past the request's ``deadline`` before anything
        was sent, the caller answers 504; once streaming, the stream ends with an error."""
        upstream, worker = opened.response, plan.worker
        answer = {h: upstream.headers[h] for h in _ANSWER_HEADERS if h in upstream.headers}
        answer[REQUEST_ID] = request[REQUEST_ID]
        sse = answer.get("Content-Type", "").startswith("text/event-stream")
        out: web.StreamResponse | None = None
        error = ""
        try:
            if not sse and upstream.content_length is not None:
                data = await upstream.read()
                if opened.prefill is not None:  # PD: a failed prefill fails the request
                    await asyncio.wait([opened.prefill])
                    if (failure := _prefill_failure(opened)) is not None:
                        raise failure
                worker.observe_ttfb(time.monotonic() - opened.sent_at)
                self._done(request, route, plan, upstream.status, opened, retries)
                return web.Response(status=upstream.status, body=data, headers=answer)
            out = _Streamed(status=upstream.status, headers=answer)
            writer = await out.prepare(request)
            assert writer is not None
            error = await _pump(worker, upstream, out, writer, opened)
        except asyncio.CancelledError:
            if out is None or not deadline.expired():
                raise  # the client left, or the caller answers 504
            # the deadline passed mid-stream: end the stream with an error event (below)
            error = f"request timeout ({self.config.admission.request_timeout_s:g}s)"
        except ConnectionResetError:  # the client went away (aiohttp's error is both kinds)
            self._done(request, route, plan, 499, opened, retries, ok=False)
            return out or web.Response(status=499)
        except aiohttp.ClientError as err:  # the whole-body read broke off: nothing sent yet
            raise _prefill_failure(opened) or UpstreamFailure(
                worker, f"{worker.url} broke off: {err}"
            ) from err
        finally:
            upstream.close()
            if opened.prefill is not None and not opened.prefill.done():
                opened.prefill.cancel()
        assert out is not None
        if error:
            worker.breaker.record_failure()
            worker.last_error = error
            log.warning(
                "rid=%s %s: stream from %s broke off: %s",
                request[REQUEST_ID],
                route,
                worker.url,
                error,
            )
            if sse:
                await out.write(_sse_error(error))
            self._done(request, route, plan, upstream.status, opened, retries, ok=False)
        else:
            self._done(request, route, plan, upstream.status, opened, retries)
        await out.write_eof()  # a no-op when the pump already ended the body
        return out

    def _done(
        self,
        request: web.Request,
        route: str,
        plan: Plan,
        status: int,
        opened: Opened,
        retries: int,
        ok: bool = True,
    ) -> None:
        worker = plan.worker
        if ok and status < 500:
            worker.breaker.record_success()
        elapsed = time.monotonic() - opened.sent_at
        worker.observe_latency(elapsed)
        self.metrics.count(route, worker.url, status)
        paired = f" (prefill {plan.prefill.url})" if plan.prefill else ""
        logs.request_line(
            f"rid={request[REQUEST_ID]} {route} -> {worker.url}{paired} status={status} "
            f"{elapsed * 1e3:.1f}ms retries={retries}"
        )


class _Streamed(web.StreamResponse):
    """A relayed stream whose status line and headers may wait for the first body chunk.

    :func:`_pump` sends them together with the first chunk when that chunk is already at
    hand, or alone at once when it is not (the client never waits for headers on our
    account). aiohttp before 3.12 ignores the attribute and sends headers at ``prepare``.
    """

    _send_headers_immediately = False


async def _pump(
    worker: Worker,
    upstream: aiohttp.ClientResponse,
    out: web.StreamResponse,
    writer: AbstractStreamWriter,
    opened: Opened,
) -> str:
    """Copy the body chunk by chunk, as it comes; the error text if the upstream broke off.

    Writes are coalesced only with what already arrived, never delayed: the headers go out
    with the first chunk when it came with them, the body's end with the last chunk when
    the upstream's end came with it. Only reads are guarded here: a failed write (client
    gone) propagates.
    """
    content = upstream.content
    try:
        chunk = content.read_nowait()
    except aiohttp.ClientError as err:
        return _broke_off(opened, err)
    if not chunk:
        send_headers = getattr(writer, "send_headers", None)  # aiohttp >= 3.12
        if send_headers is not None:
            send_headers()
    first = True
    while True:
        if not chunk:
            try:
                chunk = await content.readany()
            except aiohttp.ClientError as err:
                return _broke_off(opened, err)
            if not chunk:
                return ""
        if first:
            worker.observe_ttfb(time.monotonic() - opened.sent_at)
            first = False
        if content.at_eof():
            await out.write_eof(chunk)
            return ""
        await writer.write(chunk)
        chunk = b""


def _broke_off(opened: Opened, err: Exception) -> str:
    failure = _prefill_failure(opened)
    if failure is not None:
        return failure.message
    return f"upstream broke off: {type(err).__name__} {err}".strip()


def _prefill_failure(opened: Opened) -> UpstreamFailure | None:
    """PD: the prefill's failure, when that is why the decode's stream was closed."""
    task = opened.prefill
    if task is None or not task.done() or task.cancelled():
        return None
    err = task.exception()
    return err if isinstance(err, UpstreamFailure) else None


async def _status_failure(plan: Plan, opened: Opened) -> UpstreamFailure:
    """The failure a 5xx answer stands for. PD: when the prefill failed too, it is the
    cause (a decode answers 503 when its prefill died): the prefill is blamed, so the
    retry may pair the same decode with another prefill."""
    response = opened.response
    try:
        body = await response.read()
    except aiohttp.ClientError:
        body = None
    finally:
        response.close()
        cause = _prefill_failure(opened)
        if opened.prefill is not None:
            opened.prefill.cancel()
    if cause is not None:
        return cause
    return UpstreamFailure(
        plan.worker,
        f"{plan.worker.url} answered {response.status}",
        status=response.status,
        body=body,
        content_type=response.headers.get("Content-Type", "application/json"),
    )


def _failure_response(failure: UpstreamFailure, rid: str, attempts: int = 1) -> web.Response:
    headers = {REQUEST_ID: rid}
    if failure.body is not None:
        headers["Content-Type"] = failure.content_type
        return web.Response(status=failure.status, body=failure.body, headers=headers)
    message = (
        failure.message if attempts <= 1 else f"{attempts} attempts failed; last: {failure.message}"
    )
    return web.json_response(
        error_body(failure.status, message), status=failure.status, headers=headers
    )
