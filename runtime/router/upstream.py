"""One attempt at a request: send it to the chosen worker (or PD pair), get the headers back.

What an attempt sends is a :class:`Plan`; :func:`open_attempt` returns the answering
worker's response with its body unread, or raises :class:`UpstreamFailure` when the
attempt failed before the client saw anything (the caller may retry elsewhere). A request
whose body names a ``rid`` is an :class:`OwnedRid` while in flight: :func:`abort_on`
forwards its owner's ``/abort_request`` to the worker(s) of its current plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp
from aiohttp import web

from kvflow.runtime.router.worker import Worker
from kvflow.runtime.wire import error_body

__all__ = [
    "Answer",
    "Opened",
    "OwnedRid",
    "Plan",
    "UpstreamFailure",
    "abort_on",
    "credential_of",
    "open_attempt",
]


@dataclass(frozen=True)
class Plan:
    """``worker`` answers the client (the decode worker in PD mode); ``prefill`` gets the
    same ``body`` in PD mode, its answer drained and discarded."""

    worker: Worker
    body: bytes | None
    prefill: Worker | None = None


class Opened(NamedTuple):
    response: aiohttp.ClientResponse
    sent_at: float  # time.monotonic() when the request went out
    prefill: asyncio.Task[None] | None  # PD: the prefill request, still draining


class UpstreamFailure(Exception):
    """The attempt failed before any byte reached the client.

    ``retryable`` failures (connect errors, 5xx) count against ``worker``'s breaker; a
    non-retryable one (a prefill's 4xx) is answered to the client as it is.
    """

    def __init__(
        self,
        worker: Worker,
        message: str,
        status: int = 502,
        body: bytes | None = None,
        content_type: str = "application/json",
        retryable: bool = True,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.message = message
        self.status = status
        self.body = body
        self.content_type = content_type
        self.retryable = retryable


_NETWORK_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


async def _send(
    session: aiohttp.ClientSession,
    method: str,
    worker: Worker,
    path: str,
    body: bytes | None,
    headers: dict[str, str],
) -> aiohttp.ClientResponse:
    try:
        # A 3xx goes back to the client as it is: the router does not follow redirects.
        return await session.request(
            method, worker.target(path), data=body, headers=headers, allow_redirects=False
        )
    except _NETWORK_ERRORS as err:
        raise UpstreamFailure(worker, f"{worker.url}: {type(err).__name__} {err}".strip()) from err


async def _failure_from(
    worker: Worker, response: aiohttp.ClientResponse, what: str
) -> UpstreamFailure:
    """A 5xx (retryable) or, for PD's prefill, a 4xx (answered as is) as a failure."""
    try:
        body = await response.read()
    except _NETWORK_ERRORS:
        body = None
    finally:
        response.release()
    return UpstreamFailure(
        worker,
        f"{what} {worker.url} answered {response.status}",
        status=response.status,
        body=body,
        content_type=response.headers.get("Content-Type", "application/json"),
        retryable=response.status >= 500,
    )


async def _drain_prefill(
    session: aiohttp.ClientSession, path: str, plan: Plan, headers: dict[str, str]
) -> None:
    prefill = plan.prefill
    assert prefill is not None
    prefill.begin()
    try:
        response = await _send(session, "POST", prefill, path, plan.body, headers)
        if response.status >= 400:
            raise await _failure_from(prefill, response, "prefill")
        try:
            async for _ in response.content.iter_any():
                pass
        except _NETWORK_ERRORS as err:
            raise UpstreamFailure(prefill, f"prefill {prefill.url} broke off: {err}") from err
        finally:
            response.close()
        prefill.breaker.record_success()
    finally:
        prefill.end()


async def open_attempt(
    session: aiohttp.ClientSession,
    method: str,
    path: str,
    plan: Plan,
    headers: dict[str, str],
) -> Opened:
    """Send ``plan``; return the answering worker's response (any status, body unread).

    PD mode sends the prefill and decode requests together. A prefill failure before the
    decode's headers arrive fails the attempt; a later one closes the decode response, so
    the relay sees its stream break.
    """
    sent_at = time.monotonic()
    if plan.prefill is None:
        return Opened(
            await _send(session, method, plan.worker, path, plan.body, headers), sent_at, None
        )
    prefill = asyncio.create_task(_drain_prefill(session, path, plan, headers))
    decode = asyncio.create_task(_send(session, method, plan.worker, path, plan.body, headers))
    try:
        await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
        if prefill.done() and prefill.exception() is not None:
            raise prefill.exception()  # type: ignore[misc]
        response = await decode
    except BaseException:
        prefill.cancel()
        decode.cancel()
        with contextlib.suppress(BaseException):
            (await decode).close()
        raise

    def on_prefill_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            response.close()

    prefill.add_done_callback(on_prefill_done)
    return Opened(response, sent_at, prefill)


def credential_of(request: web.Request, api_key: str | None) -> str:
    """Who may abort a request (the workers' rule): a hash of its bearer token when the
    router has an API key, else ``anonymous``, which every client shares."""
    if not api_key:
        return "anonymous"
    token = request.headers.get("Authorization", "").encode()
    return "bearer:" + hashlib.sha256(token).hexdigest()


@dataclass
class OwnedRid:
    """A client-chosen ``rid`` in flight through this router: who sent it and the
    worker(s) of its current attempt, where ``/abort_request`` is forwarded."""

    credential: str
    plan: Plan | None = None


class Answer(NamedTuple):
    """A worker's whole answer (or the router's 502 when it could not reach it)."""

    status: int
    body: bytes
    content_type: str


async def _abort_one(
    session: aiohttp.ClientSession, worker: Worker, body: bytes, headers: dict[str, str]
) -> Answer:
    try:
        async with session.post(
            worker.target("/abort_request"), data=body, headers=headers
        ) as response:
            content_type = response.headers.get("Content-Type", "application/json")
            return Answer(response.status, await response.read(), content_type)
    except _NETWORK_ERRORS as err:
        message = f"{worker.url}: {type(err).__name__} {err}".strip()
        return Answer(502, json.dumps(error_body(502, message)).encode(), "application/json")


async def abort_on(
    session: aiohttp.ClientSession, plan: Plan, body: bytes, headers: dict[str, str]
) -> Answer:
    """``POST /abort_request`` with ``body`` to the plan's worker and, in PD mode, its
    prefill (both run the request under the client's rid): the worker's answer, or the
    prefill's 200 when only the prefill still had it. Each worker checks the credential
    in ``headers`` itself."""
    workers = [plan.worker] if plan.prefill is None else [plan.worker, plan.prefill]
    answers = await asyncio.gather(*(_abort_one(session, w, body, headers) for w in workers))
    return next((a for a in answers if a.status == 200), answers[0])
