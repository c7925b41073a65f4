"""A real ``kvflow serve`` for SGLang's frontend language, and the venv where ``sglang`` is
installed (``benchmarks/sglang_frontend_venv.py``, by ``scripts/setup.sh``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from server_process import ServerProcess
from sglang_frontend_venv import (
    SGLANG_VERSION,
    default_frontend_venv,
    installed_sglang_frontend,
)


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    python = installed_sglang_frontend(default_frontend_venv())
    if python is None:
        pytest.skip(
            f"sglang {SGLANG_VERSION} (frontend) is not installed: run scripts/setup.sh "
            "(python benchmarks/sglang_frontend_venv.py)"
        )
    return python


@pytest.fixture(scope="module")
def frontend_server(model_path, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-total-tokens",
        "6000",
        "--context-length",
        "2048",
        "--page-size",
        "1",
        log=tmp_path_factory.mktemp("frontend") / "server.log",
    )
    yield proc
    proc.stop()
