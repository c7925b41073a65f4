"""Real ``kvflow serve`` processes on the embedded model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess


@pytest.fixture(scope="session")
def embedded_ready(model_path) -> Path:
    """Convert the embedded model before any server races to do it."""
    return model_path


@pytest.fixture(scope="module")
def server(embedded_ready, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-total-tokens",
        "6000",
        "--context-length",
        "2048",
        log=tmp_path_factory.mktemp("server") / "server.log",
    )
    yield proc
    proc.stop()
