"""Runs one engine per tensor-parallel rank in spawned processes (gloo on CPU, NCCL with
one GPU per rank on CUDA) and returns every rank's results: the ranks make the same calls,
as the server's ranks do."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

RANK_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank(
    rank: int,
    size: int,
    init_addr: str,
    model_path: str,
    engine_kwargs: dict[str, Any],
    calls: list[dict[str, Any]],
    results: Any,
    device: str,
) -> None:
    import torch.distributed as dist

    from kvflow.runtime.distributed import init_tp_group
    from kvflow.runtime.engine import Engine

    try:
        where = f"cuda:{rank}" if device == "cuda" else "cpu"
        group = init_tp_group(rank, size, init_addr, where, timeout_s=RANK_TIMEOUT_S)
        engine = Engine(model_path, tp=group, tp_size=size, device=where, **engine_kwargs)
        outputs = [[r.output_ids for r in engine.generate(**call)] for call in calls]
        cache = engine.scheduler.cache
        storage = getattr(cache, "storage", None)
        for _ in range(3 if storage is not None else 0):  # every page into the store
            storage.io.drain(30.0)
            cache.poll()  # writes whose host copy landed start; ended writes unpin
        report = {
            "outputs": outputs,
            "retractions": engine.scheduler.num_retractions,
            "memory_free": engine.is_memory_free(),
            "kv_heads": engine.runner.heads.num_kv_heads,
            "host_hit_tokens": engine.scheduler.kv.hit_tokens.host,
            "storage_hit_tokens": engine.scheduler.kv.hit_tokens.storage,
        }
        results.put((rank, report))
        dist.destroy_process_group()
    except BaseException as err:  # the parent reports it
        results.put((rank, {"error": f"{type(err).__name__}: {err}"}))
        raise


def run_ranks(
    size: int,
    model_path: str,
    calls: list[dict[str, Any]],
    device: str = "cpu",
    **engine_kwargs: Any,
) -> list[dict[str, Any]]:
    """Every rank's report (``outputs``: per call, each sequence's output ids), rank order.
    ``device`` "cuda": rank ``r`` runs on GPU ``r``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_addr = f"127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(
            target=_rank,
            args=(rank, size, init_addr, model_path, engine_kwargs, calls, results, device),
        )
        for rank in range(size)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = dict(results.get(timeout=RANK_TIMEOUT_S) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    errors = {rank: r["error"] for rank, r in reports.items() if "error" in r}
    assert not errors, f"ranks failed: {errors}"
    return [reports[rank] for rank in range(size)]
