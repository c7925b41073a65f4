"""A stand-in worker that records what it receives, for what real workers cannot show.

It checks: the exact body each side of a PD pair receives, a prefill that fails on command
(4xx, 5xx) at a chosen moment, a stream whose headers come long before its first event
(when the router sends headers), the headers a request arrives with, and a redirect. It records every body and answers like a kvflow
worker (JSON or SSE). Real prefill/decode workers behind the router are tested in
tests/pd; everything else in tests/router runs against real ``kvflow serve`` workers.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web
from server_process import free_port

__all__ = ["FakeWorker"]


class FakeWorker:
    """An aiohttp server on 127.0.0.1 in its own thread; ``bodies`` lists the JSON it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each generation request's headers
        self.redirect_to: str | None = None  # answer generation requests with a 307 there
        self.fail_status: int | None = None  # answer generation requests with this status
        self.first_event_delay_s = 0.0  # a stream's headers go out, its first event this late
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake worker did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.redirect_to is not None:
            return web.Response(status=307, headers={"Location": self.redirect_to})
        if self.fail_status is not None:
            return web.json_response(
                {"error": {"message": f"{self.name} refuses", "code": self.fail_status}},
                status=self.fail_status,
            )
        if not body.get("stream"):
            return web.json_response({"text": f"from {self.name}", "worker": self.name})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await asyncio.sleep(self.first_event_delay_s)
        for piece in ("from ", self.name):
            await out.write(f"data: {json.dumps({'text': piece})}\n\n".encode())
            await asyncio.sleep(0.01)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def stop(self) -> None:
        async def shutdown() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
