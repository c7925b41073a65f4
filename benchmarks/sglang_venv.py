"""SGLang's router (PyPI ``sglang-router``, Rust) in its own virtual environment.

It pins its own aiohttp, fastapi..., so it never shares kvflow's venv. The venv is created
on first use with the ordinary pip client under ``$KVFLOW_CACHE_DIR`` (default
``~/.cache/kvflow``)/venvs/sglang-router-<version>; ``SGLANG_ROUTER_VERSION`` is the
release NOTES.md records as working here. Used by ``bench_router.py`` and by
``tests/pd/test_pd_sglang_router.py`` (a standalone module: importing it pulls in nothing
of the benchmarks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = [
    "SGLANG_ROUTER_VERSION",
    "default_sglang_venv",
    "ensure_sglang_router",
    "installed_sglang_router",
]

SGLANG_ROUTER_VERSION = "0.3.2"


def default_sglang_venv() -> Path:
    cache = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    return cache / "venvs" / f"sglang-router-{SGLANG_ROUTER_VERSION}"


def _run(argv: list[str], timeout: float) -> None:
    # cwd="/": pip run as a module puts the working directory first on sys.path, and the repo's
    # top-level operator/ folder would shadow the standard library's operator module
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, cwd="/"
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {done.returncode}: {' | '.join(tail)}")


def installed_sglang_router(venv: Path) -> Path | None:
    """The venv's python if ``sglang-router`` is installed there (no network), else None."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sglang_router"]
    found = python.exists() and subprocess.run(probe, capture_output=True, cwd="/").returncode == 0
    if found:
        return python
    return None


def ensure_sglang_router(venv: Path, timeout: float = 600.0) -> Path:
    """The venv's python, installing ``sglang-router`` there first if it is missing.

    Raises ``RuntimeError`` (with pip's last lines) or ``subprocess.TimeoutExpired``.
    """
    python = venv / "bin" / "python"
    if installed_sglang_router(venv) is not None:
        return python
    print(f"installing sglang-router=={SGLANG_ROUTER_VERSION} into {venv}", flush=True)
    _run([sys.executable, "-P", "-m", "venv", str(venv)], timeout)
    _run(
        [str(python), "-m", "pip", "install", "-q", f"sglang-router=={SGLANG_ROUTER_VERSION}"],
        timeout,
    )
    return python


if __name__ == "__main__":  # scripts/setup.sh: install it once, before any test runs
    print(ensure_sglang_router(default_sglang_venv()))
