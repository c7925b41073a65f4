"""``/abort_request`` aborts only the caller's own requests, and an aborted request never
answers 200: its client gets 499 (or an error event once streaming began).

A server with an API key binds each rid to a hash of the bearer token it came with; one
without binds every rid to ``anonymous`` (any client may abort any rid it knows). A
``kvflow router`` forwards an abort to the worker running the rid when the rid came
through it from the same credential.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess
from starlette.requests import Request

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))

from router_process import RouterProcess

from kvflow.runtime.server.http_server import credential_of
from kvflow.runtime.server.tokenizer_manager import TokenizerManager
from kvflow.runtime.wire import GenerateRequest, SamplingParams
from kvflow.runtime.wire.messages import AbortRequest

pytestmark = pytest.mark.slow

KEY = "owner-key"
TIMEOUT_S = 120
# Long enough to be aborted mid-way on a loaded 2-core machine.
LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(embedded_ready, tmp_path_factory):
    proc = ServerProcess(
        "--api-key",
        KEY,
        "--max-total-tokens",
        "4000",
        "--context-length",
        "2048",
        log=tmp_path_factory.mktemp("keyed") / "server.log",
    )
    yield proc
    proc.stop()


def _auth(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _until_running(worker: ServerProcess, key: str | None) -> None:
    async with httpx.AsyncClient(headers=_auth(key), timeout=TIMEOUT_S) as client:
        for _ in range(1200):
            info = (await client.get(f"{worker.url}/get_server_info")).json()
            if info["stats"]["num_running_reqs"]:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the request never started running")


def _generate_then_abort(
    worker: ServerProcess,
    rid: str,
    owner: str | None,
    aborter: str | None,
    max_new_tokens: int = 400,
    via: str | None = None,
) -> tuple[httpx.Response, httpx.Response]:
    """``owner`` starts a /generate named ``rid`` on ``worker`` (or through the router at
    ``via``); once it runs, ``aborter`` asks to abort it (API keys, None for none).
    Returns (the abort's answer, the generate's)."""
    body = {
        "text": "Once upon a time",
        "rid": rid,
        "sampling_params": {**LONG, "max_new_tokens": max_new_tokens},
    }

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=via or worker.url, timeout=TIMEOUT_S) as client:
            task = asyncio.create_task(client.post("/generate", json=body, headers=_auth(owner)))
            await _until_running(worker, owner)
            abort = await client.post("/abort_request", json={"rid": rid}, headers=_auth(aborter))
            return abort, await task

    return asyncio.run(run())


def test_another_key_cannot_abort_and_the_request_finishes(keyed):
    abort, result = _generate_then_abort(keyed, "a-1", KEY, "someone-else", max_new_tokens=60)
    assert abort.status_code == 401
    assert result.status_code == 200, result.text
    assert result.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert result.json()["meta_info"]["completion_tokens"] == 60


def test_own_abort_answers_499_not_200(keyed):
    abort, result = _generate_then_abort(keyed, "a-2", KEY, KEY)
    assert abort.status_code == 200
    assert abort.json() == {"rid": "a-2", "found": True}
    assert result.status_code == 499, result.text
    error = result.json()["error"]
    assert error["code"] == 499
    assert "aborted by /abort_request" in error["message"]
    keyed.wait_idle_and_free(KEY)


def test_own_abort_ends_a_stream_with_an_error_event(keyed):
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "rid": "a-3",
    }
    events = []
    with httpx.stream(
        "POST", f"{keyed.url}/v1/chat/completions", json=body, headers=_auth(), timeout=TIMEOUT_S
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:  # streaming: the request runs
                abort = httpx.post(
                    f"{keyed.url}/abort_request", json={"rid": "a-3"}, headers=_auth()
                )
                assert abort.status_code == 200, abort.text
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 499 and "aborted by /abort_request" in error["message"]
    assert not any('"finish_reason": "abort"' in e for e in events)
    keyed.wait_idle_and_free(KEY)


def test_unknown_rid_and_abort_all_are_refused(keyed):
    unknown = httpx.post(f"{keyed.url}/abort_request", json={"rid": "nope"}, headers=_auth())
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "no request 'nope' of this credential is in flight"
    everything = httpx.post(f"{keyed.url}/abort_request", json={"abort_all": True}, headers=_auth())
    assert everything.status_code == 400
    assert "abort_all is not supported" in everything.json()["error"]["message"]


def test_an_owner_binding_refuses_other_credentials_as_unknown_rids():
    """The table behind /abort_request: a rid started by A is not B's to abort, and B's
    refusal is the one an unknown rid gets (a server with one API key has one credential,
    so two credentials meet only here)."""
    sent: list[object] = []
    tm = TokenizerManager.__new__(TokenizerManager)
    tm.states = {}
    tm.to_scheduler = type("Recorder", (), {"send": staticmethod(sent.append)})()
    a = credential_of(_request("Bearer key-a"), api_key="key-a")
    b = credential_of(_request("Bearer key-b"), api_key="key-a")
    assert a != b and a.startswith("bearer:") and "key-a" not in a
    tm._submit(GenerateRequest(input_ids=[1], sampling=SamplingParams(), rid="r"), a)
    assert not tm.abort_owned("r", b)
    assert not tm.abort_owned("unknown", b)
    assert sent[1:] == []
    assert tm.abort_owned("r", a)
    assert sent[-1] == AbortRequest("r", "aborted by /abort_request")
    assert tm.states["r"].abort_error.status == 499
    assert credential_of(_request("Bearer anything"), api_key=None) == "anonymous"


def test_anonymous_server_any_client_aborts_a_known_rid(server):
    """Without an API key every client is ``anonymous``: rid ownership cannot tell them
    apart (documented); the aborted client still gets 499, never a 200."""
    abort, result = _generate_then_abort(server, "anon-1", None, None)
    assert abort.status_code == 200
    assert result.status_code == 499, result.text
    server.wait_idle_and_free()


def test_a_rid_in_flight_is_refused_to_anyone(server):
    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as client:
            body = {"text": "Once upon a time", "rid": "dup", "sampling_params": LONG}
            first = asyncio.create_task(client.post("/generate", json=body))
            await _until_running(server, None)
            second = await client.post("/generate", json=body)
            await client.post("/abort_request", json={"rid": "dup"})
            return second, await first

    second, first = asyncio.run(run())
    assert second.status_code == 400
    assert "already in flight" in second.json()["error"]["message"]
    assert first.status_code == 499
    server.wait_idle_and_free()


@pytest.fixture(scope="module")
def router(server, tmp_path_factory):
    proc = RouterProcess(
        "--worker-urls", server.url, log=tmp_path_factory.mktemp("router") / "router.log"
    )
    yield proc
    proc.stop()


def test_router_forwards_the_abort_of_a_rid_it_carries(server, router):
    abort, result = _generate_then_abort(server, "via-router", None, None, via=router.url)
    assert abort.status_code == 200, abort.text
    assert result.status_code == 499, result.text
    unknown = httpx.post(f"{router.url}/abort_request", json={"rid": "via-router"})
    assert unknown.status_code == 404  # finished: no longer the router's
    server.wait_idle_and_free()


def _request(authorization: str) -> Request:
    headers = [(b"authorization", authorization.encode())]
    return Request({"type": "http", "headers": headers})
