"""SGLang's own router (PyPI ``sglang-router``, from its own venv) in PD mode, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from server_process import free_port
from sglang_venv import SGLANG_ROUTER_VERSION, default_sglang_venv, installed_sglang_router

START_TIMEOUT_S = 60


class SglangRouterProcess:
    """``sglang_router.launch_router --pd-disaggregation`` in front of one prefill/decode
    pair, on loopback only (its Prometheus listener included); ``url`` is its base URL."""

    def __init__(
        self, python: Path, prefill_url: str, bootstrap_port: int, decode_url: str, log: Path
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [str(python), "-P", "-m", "sglang_router.launch_router"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        argv += ["--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port)]
        argv += ["--decode", decode_url, "--request-timeout-secs", "180"]
        env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        self.proc = subprocess.Popen(
            argv,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited {self.proc.returncode}: {self.tail()}")
            try:
                # 200 once it has registered both workers as healthy
                if httpx.get(f"{self.url}/readiness", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"sglang-router not ready after {START_TIMEOUT_S} s: {self.tail()}")

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_sglang_router(
    prefill_url: str, bootstrap_port: int, decode_url: str, log: Path
) -> SglangRouterProcess:
    """sglang-router in PD mode in front of one pair, from the venv scripts/setup.sh installs
    (tests reach no network). Not installed: a skip (a failure in CI, see conftest.py);
    installed but not starting: a failure."""
    python = installed_sglang_router(default_sglang_venv())
    if python is None:
        pytest.skip(
            f"sglang-router {SGLANG_ROUTER_VERSION} is not installed in "
            f"{default_sglang_venv()} (scripts/setup.sh installs it)"
        )
    try:
        return SglangRouterProcess(python, prefill_url, bootstrap_port, decode_url, log=log)
    except (OSError, RuntimeError) as err:
        pytest.fail(f"sglang-router {SGLANG_ROUTER_VERSION} did not start: {err}")
