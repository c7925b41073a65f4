"""A LOAD TARGET, not a model server: a minimal fast OpenAI-style streaming upstream.

It exists only to measure what a router adds. ``/v1/chat/completions`` and
``/v1/completions`` answer at once with ``--chunks`` SSE events, ``--interval-ms`` apart;
every event carries ``"sent_ns"``, the ``time.monotonic_ns()`` at which it was written
(CLOCK_MONOTONIC is one clock for every process of the machine, so the client can compute
each chunk's one-way latency). It also answers what routers probe before sending work:
``/health``, ``/health_generate``, ``/metrics`` (SGLang's load gauges, always zero),
``/v1/models``, ``/get_model_info``, ``/get_server_info``, ``/flush_cache``.

    python benchmarks/router/loadtarget.py --port 18000 [--chunks 16] [--interval-ms 2]

Run as a script (no imports from the benchmark package), one process, uvloop when present.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

MODEL = "load-target"
_METRICS = (
    b'sglang:num_running_reqs{model_name="load-target"} 0\n'
    b'sglang:num_queue_reqs{model_name="load-target"} 0\n'
)


def _event(kind: str, index: int, text: str, finish: str | None) -> bytes:
    """One SSE event; ``sent_ns`` is filled in at write time (last field, fixed position)."""
    if kind == "chat":
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        obj = "text_completion"
    event = {"id": f"lt-{index}", "object": obj, "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode()[:-1] + b',"sent_ns":'


class LoadTarget:
    """The handlers; ``chunks`` text events then a usage event and ``[DONE]``."""

    def __init__(self, chunks: int, interval_s: float) -> None:
        self.chunks = chunks
        self.interval_s = interval_s
        self.heads = {
            kind: [_event(kind, i, "tok ", None) for i in range(chunks)]
            for kind in ("chat", "text")
        }
        usage = {"prompt_tokens": 8, "completion_tokens": chunks, "total_tokens": 8 + chunks}
        self.tails = {
            kind: b"data: "
            + json.dumps(
                {
                    "id": "lt-end",
                    "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "model": MODEL,
                    "choices": [],
                    "usage": usage,
                }
            ).encode()
            + b"\n\ndata: [DONE]\n\n"
            for kind in ("chat", "text")
        }

    async def generate(self, request: web.Request) -> web.StreamResponse:
        kind = "chat" if request.path.endswith("chat/completions") else "text"
        body = await request.read()
        if b'"stream":true' not in body.replace(b" ", b""):
            text = "tok " * self.chunks
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if kind == "chat"
                else {"index": 0, "text": text}
            )
            return web.json_response({"id": "lt", "model": MODEL, "choices": [choice]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for head in self.heads[kind]:
            await out.write(head + str(time.monotonic_ns()).encode() + b"}\n\n")
            if self.interval_s:
                await asyncio.sleep(self.interval_s)
        await out.write(self.tails[kind])
        await out.write_eof()
        return out

    @staticmethod
    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @staticmethod
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=_METRICS, content_type="text/plain")

    @staticmethod
    async def models(_request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
        )

    @staticmethod
    async def model_info(_request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
        )

    @staticmethod
    async def server_info(_request: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "dp_size": 1, "load": 0})


def build_app(chunks: int, interval_s: float) -> web.Application:
    target = LoadTarget(chunks, interval_s)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", target.generate)
    app.router.add_post("/v1/completions", target.generate)
    for path in ("/health", "/health_generate", "/flush_cache"):
        app.router.add_route("*", path, target.ok)
    app.router.add_get("/metrics", target.metrics)
    app.router.add_get("/v1/models", target.models)
    app.router.add_get("/get_model_info", target.model_info)
    app.router.add_get("/get_server_info", target.server_info)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--interval-ms", type=float, default=2.0)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(
        build_app(args.chunks, args.interval_ms / 1e3),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
