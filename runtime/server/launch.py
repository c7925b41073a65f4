"""Starts one runtime instance: scheduler and detokenizer subprocesses, then the HTTP server.

Start-up waits until every subprocess reports ready; if one dies meanwhile (the OOM killer,
say) the server reaps the others and exits 1, naming the child and the signal. If a
subprocess dies later, in-flight and new requests fail with 503 and the server exits 1. SIGTERM drains: new requests
get 503, in-flight ones finish (up to ``drain_timeout``), then children are reaped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import uvicorn

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.models import check_supported
from kvflow.runtime.models.loader import resolve_model_path
from kvflow.runtime.server.args import ServerArgs
from kvflow.runtime.server.detokenizer_process import run_detokenizer_process
from kvflow.runtime.server.http_server import create_app
from kvflow.runtime.server.ipc import IpcPaths, make_ipc_paths
from kvflow.runtime.server.lifeline import run_tied_to_parent
from kvflow.runtime.server.parallel import check_parallel, rank_places
from kvflow.runtime.server.scheduler_process import run_scheduler_process
from kvflow.runtime.server.tokenizer_manager import TokenizerManager
from kvflow.runtime.tokenizer import load_chat_template, load_tokenizer, tokenizer_folder

__all__ = ["launch_server"]
logger = logging.getLogger("kvflow.server")
_START_TIMEOUT_S = 900.0
_MONITOR_INTERVAL_S = 0.5


class StartupError(RuntimeError):
    pass


def _spawn_children(
    args: ServerArgs, paths: IpcPaths
) -> tuple[list[BaseProcess], list[tuple[str, Connection]]]:
    """Start the scheduler(s) and the detokenizer; each reports on its pipe once ready
    (:func:`_wait_ready`). The caller reaps them on any failure."""
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA state
    engine = args.engine
    folder = tokenizer_folder(
        engine.tokenizer_path, engine.skip_tokenizer_init, Path(engine.model_path or ".")
    )
    tokenizer_path = None if folder is None else str(folder)
    places = rank_places(engine)
    specs: list[tuple[str, Any, tuple]] = [
        (
            "scheduler"
            + (f"-dp{place.dp_rank}" if engine.dp_size > 1 else "")
            + (f"-tp{place.tp_rank}" if engine.tp_size > 1 else ""),
            run_scheduler_process,
            (args, paths, place),
        )
        for place in places
    ]
    specs.append(("detokenizer", run_detokenizer_process, (tokenizer_path, paths)))
    procs: list[BaseProcess] = []
    pipes = []
    for name, target, target_args in specs:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_tied_to_parent,
            args=(os.getpid(), target, *target_args, writer),
            name=f"kvflow-{name}",
        )
        proc.start()
        procs.append(proc)
        pipes.append((name, reader))
    return procs, pipes


def _wait_ready(pipes: list[tuple[str, Connection]], procs: list[BaseProcess]) -> dict[str, Any]:
    """Each child's ready message, in order; :class:`StartupError` as soon as any child
    exits (a dead child's pipe reads as end-of-file) or the start-up budget runs out."""
    info: dict[str, Any] = {}
    deadline = time.monotonic() + _START_TIMEOUT_S
    for name, reader in pipes:
        while not reader.poll(0.5):
            _check_alive(procs, "while starting")
            if time.monotonic() > deadline:
                raise StartupError(
                    f"the {name} process did not become ready in {_START_TIMEOUT_S:.0f} s"
                )
        try:
            status, payload = reader.recv()
        except EOFError:
            _check_alive(procs, "while starting", wait_s=5.0)
            raise StartupError(f"the {name} process closed its pipe while starting") from None
        if status != "ready":
            raise StartupError(f"the {name} process failed to start: {payload}")
        info.update(payload)
    return info


def describe_exit(proc: BaseProcess) -> str:
    """How a child ended: its exit code, or the signal that killed it (SIGKILL is what the
    kernel's out-of-memory killer sends, as in a container over its memory limit)."""
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"{proc.name} was killed by {signame}{hint}"
    return f"{proc.name} exited with code {code}"


def _check_alive(procs: list[BaseProcess], when: str, wait_s: float = 0.0) -> None:
    """Raise :class:`StartupError` naming every child that has ended (waiting up to
    ``wait_s`` for one that is on its way out)."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [p for p in procs if not p.is_alive()]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if dead:
        raise StartupError(f"{', '.join(describe_exit(p) for p in dead)} {when}")


def _reap(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


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


def launch_server(args: ServerArgs) -> int:
    """Run until SIGTERM/SIGINT or a subprocess failure; returns the process exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    engine = args.engine.resolved()
    # Resolve (and, for the embedded model, convert) once here, before children race on it.
    model_path = resolve_model_path(engine.model_path, engine.load_format)
    args = dataclasses.replace(args, engine=dataclasses.replace(engine, model_path=str(model_path)))
    try:  # what the checkpoint and the parallel settings ask for, before any process starts
        check_supported(ModelConfig.from_path(model_path), args.engine.context_length)
        check_parallel(args.engine, args.role, model_path)
    except ValueError as err:
        logger.error("start-up refused: %s", err)
        return 2
    paths = make_ipc_paths()
    procs: list[BaseProcess] = []
    try:
        procs, pipes = _spawn_children(args, paths)
        # NOTE: the tokenizer loads while the children start: its imports overlap the
        # scheduler's model load (embedded model, 2 cores: 8.4 s -> 6.8 s to /health)
        folder = tokenizer_folder(
            args.engine.tokenizer_path, args.engine.skip_tokenizer_init, model_path
        )
        tokenizer = None if folder is None else load_tokenizer(folder)
        if tokenizer is not None and args.chat_template:  # SGLang's: replaces the tokenizer's
            tokenizer.chat_template = load_chat_template(args.chat_template)
        info = _wait_ready(pipes, procs)
        tm = TokenizerManager(args, paths, info, tokenizer)
        return asyncio.run(_serve(args, tm, procs))
    except StartupError as err:
        logger.error("start-up failed: %s; the server exits", err)
        return 1
    finally:
        _reap(procs)
