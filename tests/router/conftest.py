"""Real ``kvflow serve`` workers for the router tests, started once per test module (a
session-wide pair would stay in memory beside every later module's servers)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# The server tests' process helper (tests/server/server_process.py) is reused as it is.
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from router_process import WORKER_FLAGS, start_worker


@pytest.fixture(scope="module")
def workers(model_path, tmp_path_factory) -> Iterator[list]:
    """Two workers on the embedded model (the fault tests kill and restart one of them)."""
    logs = tmp_path_factory.mktemp("router-workers")
    with ThreadPoolExecutor(2) as pool:  # start both at once: each load takes tens of seconds
        futures = [
            pool.submit(start_worker, *WORKER_FLAGS, log=logs / f"worker{i}.log") for i in range(2)
        ]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < len(futures):
            raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
        yield started
    finally:
        for proc in started:
            proc.stop()
