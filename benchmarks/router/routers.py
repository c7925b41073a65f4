"""The routers under test: ``kvflow router`` and SGLang's ``sglang-router`` (PyPI, Rust).

sglang-router lives in its own virtual environment (it pins its own aiohttp, fastapi...),
created on first use with the ordinary pip client; ``SGLANG_ROUTER_VERSION`` is the
release NOTES.md records as working here. Both routers run with their default logging
(one or two lines per request to a log file) and their default timeouts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from serving.servers import free_port

from .procs import Launch

__all__ = [
    "SGLANG_ROUTER_VERSION",
    "default_sglang_venv",
    "ensure_sglang_router",
    "kvflow_router",
    "sglang_router",
]

SGLANG_ROUTER_VERSION = "0.3.2"


def default_sglang_venv() -> Path:
    cache = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    return cache / "venvs" / f"sglang-router-{SGLANG_ROUTER_VERSION}"


def ensure_sglang_router(venv: Path, timeout: float = 600.0) -> Path:
    """The venv's python, installing ``sglang-router`` there first if it is missing."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sglang_router"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    print(f"installing sglang-router=={SGLANG_ROUTER_VERSION} into {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=timeout)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"sglang-router=={SGLANG_ROUTER_VERSION}"],
        check=True,
        timeout=timeout,
    )
    return python


def kvflow_router(name: str, policy: str, workers: list[str], python: str) -> Launch:
    port = free_port()
    argv = [python, "-P", "-m", "kvflow", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--policy", policy, "--worker-urls", ",".join(workers)]
    return Launch(name, argv, f"http://127.0.0.1:{port}", ready_path="/health_generate")


def sglang_router(name: str, policy: str, workers: list[str], python: Path) -> Launch:
    port = free_port()
    # NOTE: each instance needs its own metrics port (default 29000 for all).
    argv = [str(python), "-P", "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--prometheus-port", str(free_port())]
    argv += ["--policy", policy, "--worker-urls", *workers]
    # /readiness answers 200 once the router has registered a healthy worker.
    return Launch(name, argv, f"http://127.0.0.1:{port}", ready_path="/readiness")
