"""Starts one runtime instance: scheduler and detokenizer subprocesses, then the HTTP server
(``http_serve``); on a node past the first (``--node-rank`` > 0) only its scheduler ranks.

Start-up waits until every subprocess reports ready; if one dies meanwhile (the OOM killer,
say) the server reaps the others and exits 1, naming the child and the signal. If a
subprocess dies later, in-flight and new requests fail with 503 and the server exits 1. SIGTERM drains: new requests
get 503, in-flight ones finish (up to ``drain_timeout``), then children are reaped.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.models import check_draft_model, check_supported, resolve_model_path
from kvflow.runtime.server.args import ServerArgs
from kvflow.runtime.server.ipc import IpcPaths, make_ipc_paths, remove_ipc_paths
from kvflow.runtime.server.lifeline import describe_exit, run_tied_to_parent
from kvflow.runtime.server.parallel import check_parallel, rank_places
from kvflow.runtime.tokenizer import load_chat_template, load_tokenizer, tokenizer_folder

__all__ = ["launch_server"]
logger = logging.getLogger("kvflow.server")
_START_TIMEOUT_S = 900.0


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
    specs: list[tuple[str, str, tuple]] = [
        (
            "scheduler"
            + (f"-dp{place.dp_rank}" if engine.dp_size > 1 else "")
            + (f"-tp{place.tp_rank}" if engine.tp_size > 1 else ""),
            "kvflow.runtime.server.scheduler_process:run_scheduler_process",
            (args, paths, place),
        )
        for place in places
    ]
    if engine.node_rank == 0:  # the other nodes only run ranks (rank 0 answers)
        specs.append(
            (
                "detokenizer",
                "kvflow.runtime.server.detokenizer_process:run_detokenizer_process",
                (tokenizer_path, paths),
            )
        )
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


def _run_ranks_only(args: ServerArgs, procs: list[BaseProcess]) -> int:
    """A node past the first (``--node-rank`` > 0): no HTTP server, its ranks serve node
    0's requests. Runs until one of them ends (exit 1: its group cannot go on; the other
    nodes' ranks fail their next collective and end too) or SIGTERM/SIGINT (exit 0)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    engine = args.engine
    logger.info(
        "node %d of %d: %d tensor-parallel ranks joined at %s (node 0 serves HTTP)",
        engine.node_rank,
        engine.nnodes,
        len(procs),
        engine.dist_init_addr,
    )
    while not stop.wait(0.2):
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            logger.error("%s; this node exits", ", ".join(describe_exit(p) for p in dead))
            return 1
    return 0


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
        model_config = ModelConfig.from_path(model_path)
        check_supported(model_config, args.engine.context_length)
        check_draft_model(args.engine, model_config)
        check_parallel(args.engine, args.role, model_path)
    except ValueError as err:
        logger.error("start-up refused: %s", err)
        return 2
    paths = make_ipc_paths()
    procs: list[BaseProcess] = []
    try:
        procs, pipes = _spawn_children(args, paths)
        if args.engine.node_rank > 0:
            _wait_ready(pipes, procs)
            return _run_ranks_only(args, procs)
        # NOTE: while the children start, the HTTP side imports (fastapi, pydantic, uvicorn:
        # 0.3 s) and loads the tokenizer, overlapping the scheduler's imports and model load
        from kvflow.runtime.server.http_serve import serve_http

        folder = tokenizer_folder(
            args.engine.tokenizer_path, args.engine.skip_tokenizer_init, model_path
        )
        tokenizer = None if folder is None else load_tokenizer(folder)
        if tokenizer is not None and args.chat_template:  # SGLang's: replaces the tokenizer's
            tokenizer.chat_template = load_chat_template(args.chat_template)
        info = _wait_ready(pipes, procs)
        return serve_http(args, paths, info, tokenizer, procs)
    except StartupError as err:
        logger.error("start-up failed: %s; the server exits", err)
        return 1
    finally:
        _reap(procs)
        remove_ipc_paths(paths)
