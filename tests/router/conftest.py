"""Real ``kvflow serve`` workers shared by the router tests, started once per session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The server tests' process helper (tests/server/server_process.py) is reused as it is.
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from router_process import start_worker

WORKER_FLAGS = ("--max-total-tokens", "6000", "--context-length", "2048")


@pytest.fixture(scope="session")
def workers(model_path, tmp_path_factory) -> Iterator[list]:
    """Two workers on the embedded model (the fault tests kill and restart one of them)."""
    logs = tmp_path_factory.mktemp("router-workers")
    started = []
    try:
        for i in range(2):
            started.append(start_worker(*WORKER_FLAGS, log=logs / f"worker{i}.log"))
        yield started
    finally:
        for proc in started:
            proc.stop()
