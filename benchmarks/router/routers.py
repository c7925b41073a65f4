"""The routers under test: ``kvflow router`` and SGLang's ``sglang-router`` (PyPI, Rust).

sglang-router lives in its own virtual environment, created on first use
(``sglang_venv.py``, shared with the PD tests). Both routers run with their default logging
(one or two lines per request to a log file) and their default timeouts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from serving.servers import free_port
from sglang_venv import SGLANG_ROUTER_VERSION, default_sglang_venv, ensure_sglang_router

from .procs import Launch

__all__ = [
    "SGLANG_ROUTER_VERSION",
    "default_sglang_venv",
    "ensure_sglang_router",
    "kvflow_baseline_router",
    "kvflow_router",
    "sglang_router",
]


def kvflow_router(name: str, policy: str, workers: list[str], python: str) -> Launch:
    port = free_port()
    argv = [python, "-P", "-m", "kvflow", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--policy", policy, "--worker-urls", ",".join(workers)]
    return Launch(name, argv, f"http://127.0.0.1:{port}", ready_path="/health_generate")


def kvflow_baseline_router(
    name: str, policy: str, workers: list[str], python: str, runtime_dir: Path
) -> Launch:
    """``kvflow router`` with ``kvflow.runtime.router`` from ``runtime_dir`` (an older
    revision's copy, see ``baseline_router.py``), the rest of kvflow from this checkout."""
    launch = kvflow_router(name, policy, workers, python)
    shim = Path(__file__).with_name("baseline_router.py")
    return dataclasses.replace(
        launch, argv=[python, "-P", str(shim), str(runtime_dir), *launch.argv[4:]]
    )


def sglang_router(name: str, policy: str, workers: list[str], python: Path) -> Launch:
    port = free_port()
    # NOTE: each instance needs its own metrics port (default 29000 for all).
    argv = [str(python), "-P", "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--prometheus-port", str(free_port())]
    argv += ["--policy", policy, "--worker-urls", *workers]
    # /readiness answers 200 once the router has registered a healthy worker.
    return Launch(name, argv, f"http://127.0.0.1:{port}", ready_path="/readiness")
