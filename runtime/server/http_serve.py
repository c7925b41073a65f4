"""The HTTP side of a runtime instance: the API on uvicorn, until SIGTERM/SIGINT drains it
or a child process dies (its requests then fail with 503 and the server exits 1).

Imported by the launcher once the children are spawned: fastapi and pydantic load while
the scheduler loads the model."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn

from kvflow.runtime.server.args import ServerArgs
from kvflow.runtime.server.http_server import create_app
from kvflow.runtime.server.ipc import IpcPaths
from kvflow.runtime.server.lifeline import describe_exit
from kvflow.runtime.server.tokenizer_manager import TokenizerManager

__all__ = ["serve_http"]
logger = logging.getLogger("kvflow.server")
_MONITOR_INTERVAL_S = 0.5


def serve_http(
    args: ServerArgs,
    paths: IpcPaths,
    info: dict[str, Any],
    tokenizer: Any,
    procs: list[BaseProcess],
) -> int:
    """Serve with the children's ready ``info`` until shut down; the process exit code."""
    return asyncio.run(_serve(args, TokenizerManager(args, paths, info, tokenizer), procs))


async def _serve(args: ServerArgs, tm: TokenizerManager, procs: list[BaseProcess]) -> int:
    tm.start()
    config = uvicorn.Config(
        create_app(tm),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        lifespan="off",
        access_log=False,
    )
    server = uvicorn.Server(config)
    exit_code = 0
    serve_task = asyncio.create_task(server.serve())
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.05)
    if serve_task.done():
        await serve_task
        return 1  # could not bind, for instance

    async def drain() -> None:
        if tm.draining:
            return
        tm.draining = True
        logger.info(
            "draining %d in-flight requests (up to %.0f s)", tm.num_in_flight, args.drain_timeout
        )
        deadline = time.monotonic() + args.drain_timeout
        while tm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        tm.abort_all("the server is shutting down")
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(drain()))
    logger.info("kvflow serving %s on http://%s:%d", args.model_name, args.host, args.port)
    print(f"kvflow: serving {args.model_name} at http://{args.host}:{args.port}/v1", flush=True)
    while not serve_task.done():
        dead = [p for p in procs if not p.is_alive()]
        if dead and not tm.dead_reason:
            reason = ", ".join(describe_exit(p) for p in dead)
            logger.error("subprocess died: %s; the server exits", reason)
            tm.fail_all(reason)
            exit_code = 1
            await asyncio.sleep(_MONITOR_INTERVAL_S)  # let handlers answer 503
            server.should_exit = True
        await asyncio.sleep(_MONITOR_INTERVAL_S)
    await serve_task
    return exit_code
