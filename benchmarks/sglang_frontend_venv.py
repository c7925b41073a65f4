"""SGLang's frontend language (PyPI ``sglang``, ``sglang.lang``) in its own virtual environment.

``sglang`` is installed ``--no-deps`` (its full dependency set is the whole SGLang server);
the venv sees kvflow's own packages (torch, transformers, numpy, requests, aiohttp...)
through a ``.pth`` file naming ``.venv``'s site-packages, and gets only the few light
packages that ``import sglang`` needs beyond those (:data:`FRONTEND_EXTRAS`). Created on
first use under ``$KVFLOW_CACHE_DIR`` (default ``~/.cache/kvflow``)/venvs/sglang-frontend-<version>
by ``scripts/setup.sh``, so ``tests/frontend`` never reaches the network (they skip with the
reason if it is missing).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

__all__ = [
    "FRONTEND_EXTRAS",
    "SGLANG_VERSION",
    "default_frontend_venv",
    "ensure_sglang_frontend",
    "installed_sglang_frontend",
]

SGLANG_VERSION = "0.5.23"
# What ``import sglang`` (sglang/__init__.py -> srt.environ, srt.utils, lang.*) imports that
# kvflow's venv does not have.
FRONTEND_EXTRAS = ("msgspec", "orjson", "pybase64", "ipython", "setproctitle", "pillow")
PROBE = "import sglang; from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint"


def default_frontend_venv() -> Path:
    cache = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    return cache / "venvs" / f"sglang-frontend-{SGLANG_VERSION}"


def _run(argv: list[str], timeout: float) -> None:
    # NOTE: run from "/": the repo root's operator/ folder would shadow Python's operator
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, cwd="/"
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {done.returncode}: {' | '.join(tail)}")


def installed_sglang_frontend(venv: Path) -> Path | None:
    """The venv's python if ``import sglang`` works there (no network), else None."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", PROBE]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if (
        python.exists()
        and subprocess.run(probe, capture_output=True, check=False, env=env, cwd="/").returncode
        == 0
    ):
        return python
    return None


def ensure_sglang_frontend(venv: Path, timeout: float = 900.0) -> Path:
    """The venv's python, creating it and installing ``sglang`` there first if missing.

    Raises ``RuntimeError`` (with pip's last lines) or ``subprocess.TimeoutExpired``.
    """
    python = venv / "bin" / "python"
    if installed_sglang_frontend(venv) is not None:
        return python
    print(f"installing sglang=={SGLANG_VERSION} (frontend) into {venv}", flush=True)
    _run([sys.executable, "-P", "-m", "venv", str(venv)], timeout)
    project = [p for p in site.getsitepackages() if p.endswith("site-packages")]
    ours = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout.strip()
    # after the venv's own site-packages: its pinned extras win over the project's
    Path(ours, "kvflow-project.pth").write_text("\n".join(project) + "\n")
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"], timeout)
    _run([*pip, *FRONTEND_EXTRAS], timeout)
    if installed_sglang_frontend(venv) is None:
        raise RuntimeError(f"sglang installed into {venv} but `{PROBE}` fails there")
    return python


if __name__ == "__main__":  # scripts/setup.sh: install it once, before any test runs
    print(ensure_sglang_frontend(default_frontend_venv()))
