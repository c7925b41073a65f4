"""Faults between router, prefill and decode: killed peers and client aborts end requests
with an error in bounded time and leave both sides idle (own stack: peers get killed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from pd_flags import COMMON, trusting
from router_process import RouterProcess, start_worker
from server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow

# Long enough (many 64-token chunks on the prefill) that a fault lands mid-request.
LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(120))


class Stack:
    def __init__(self, logs) -> None:
        self.logs = logs
        self.bootstrap_port = free_port()
        self.prefill_port = free_port()
        self.decode_port = free_port()
        self.prefill = self.start_prefill()
        self.decode = self.start_decode()
        self.router = RouterProcess(
            "--prefill-urls",
            f"{self.prefill.url}#{self.bootstrap_port}",
            "--decode-urls",
            self.decode.url,
            "--health-interval-s",
            "0.3",
            log=logs / "router.log",
        )

    def start_prefill(self) -> ServerProcess:
        flags = ("--role", "prefill", "--bootstrap-port", str(self.bootstrap_port), *COMMON)
        return start_worker(*flags, log=self.logs / "prefill.log", port=self.prefill_port)

    def start_decode(self) -> ServerProcess:
        return start_worker(
            "--role",
            "decode",
            *trusting(self.bootstrap_port),
            *COMMON,
            log=self.logs / "decode.log",
            port=self.decode_port,
        )

    def stop(self) -> None:
        for proc in (self.router, self.prefill, self.decode):
            proc.stop()


@pytest.fixture(scope="module")
def stack(model_path, tmp_path_factory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("pd-faults"))
    yield stack
    stack.stop()


def _ask(url: str, content: str, max_tokens: int = 16, timeout: float = 120) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def _ok(stack: Stack) -> None:
    response = _ask(stack.router.url, "What is the capital of France?", max_tokens=8)
    assert response.status_code == 200, response.text


def test_killing_the_prefill_fails_the_request_in_bounded_time(stack):
    _ok(stack)

    async def scenario() -> tuple[int, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
            call = asyncio.create_task(
                client.post(f"{stack.router.url}/v1/chat/completions", json=body)
            )
            await asyncio.sleep(1.0)  # the prefill is working through the prompt's chunks
            stack.prefill.proc.kill()
            killed = time.monotonic()
            response = await call
            return response.status_code, time.monotonic() - killed

    status, after_kill = asyncio.run(scenario())
    assert status >= 500  # an error, not a hang (no other prefill to retry on)
    assert after_kill < 12  # the decode's timeout (5 s) plus the router's retries
    stack.decode.wait_idle_and_free(timeout=30)
    stack.prefill = stack.start_prefill()
    deadline = time.monotonic() + 30
    while _ask(stack.router.url, "Hi", max_tokens=4).status_code != 200:
        assert time.monotonic() < deadline, "the restarted prefill never served"
        time.sleep(1)
    _ok(stack)
    stack.decode.wait_idle_and_free(timeout=30)
    stack.prefill.wait_idle_and_free(timeout=30)


def test_client_abort_mid_request_leaves_both_sides_idle(stack):
    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 64}
            call = asyncio.create_task(
                client.post(f"{stack.router.url}/v1/chat/completions", json=body)
            )
            await asyncio.sleep(1.5)
            call.cancel()  # the client goes away: the router closes both upstream requests

    asyncio.run(scenario())
    stack.decode.wait_idle_and_free(timeout=30)
    stack.prefill.wait_idle_and_free(timeout=30)
    _ok(stack)


def test_killing_the_decode_frees_the_prefill(stack):
    async def scenario() -> int:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
            call = asyncio.create_task(
                client.post(f"{stack.router.url}/v1/chat/completions", json=body)
            )
            await asyncio.sleep(1.0)
            stack.decode.proc.kill()
            return (await call).status_code

    assert asyncio.run(scenario()) >= 500
    stack.prefill.wait_idle_and_free(timeout=30)  # the room fails; its KV is released
    stack.decode = stack.start_decode()


def test_a_stream_whose_prefill_dies_is_retried_on_another_prefill(stack, tmp_path):
    """A streamed request whose prefill dies before the first token: the decode answers 503
    (a stream's status waits for its first output, so nothing was sent yet), the router
    blames the prefill and retries on the other one with the same decode, and the client
    gets 200 and the whole stream, with no error event."""
    deadline = time.monotonic() + 60
    while _ask(stack.router.url, "Hi", max_tokens=4).status_code != 200:  # decode restarted
        assert time.monotonic() < deadline, "the restarted decode never served"
        time.sleep(1)
    bootstrap = free_port()
    spare = start_worker(
        "--role", "prefill", "--bootstrap-port", str(bootstrap), *COMMON, log=tmp_path / "spare.log"
    )
    added = {"url": spare.url, "role": "prefill", "bootstrap_port": bootstrap}
    admin = stack.router.admin_headers()
    unsigned = httpx.post(f"{stack.router.url}/workers", json=added, timeout=10)
    assert unsigned.status_code == 401, unsigned.text  # the admin routes need the internal key
    added_response = httpx.post(
        f"{stack.router.url}/workers", json=added, headers=admin, timeout=10
    )
    assert added_response.status_code < 300, added_response.text
    stack.router.wait_for(lambda ws: ws.get(spare.url, {}).get("healthy"), "the spare prefill")

    def running(server: ServerProcess) -> int:
        return int(server.server_info()["stats"]["num_running_reqs"])

    async def scenario() -> tuple[ServerProcess, int, str]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 8,
                "stream": True,
            }

            async def read() -> tuple[int, str]:
                url = f"{stack.router.url}/v1/chat/completions"
                async with client.stream("POST", url, json=body) as response:
                    return response.status_code, (await response.aread()).decode()

            call = asyncio.create_task(read())
            victim = None
            while victim is None:  # the prefill working through the prompt's chunks
                victim = next((p for p in (stack.prefill, spare) if running(p)), None)
                await asyncio.sleep(0.05)
            victim.proc.kill()
            return victim, *(await call)

    victim, status, text = asyncio.run(scenario())
    survivor = spare if victim is stack.prefill else stack.prefill
    try:
        assert status == 200, text
        assert '"error"' not in text, text
        assert '"finish_reason":"length"' in text.replace(" ", ""), text
        assert text.rstrip().endswith("data: [DONE]"), text
        assert stack.router.workers()[victim.url]["last_error"], "the prefill was not blamed"
        survivor.wait_idle_and_free(timeout=30)
        stack.decode.wait_idle_and_free(timeout=30)
    finally:
        httpx.delete(
            f"{stack.router.url}/workers/{quote(spare.url, safe='')}", headers=admin, timeout=10
        )
        spare.stop()
        if victim is stack.prefill:
            stack.prefill = stack.start_prefill()
