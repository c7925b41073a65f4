"""A real ``kvflow router`` process for tests, and a ``kvflow serve`` worker on a fixed port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import httpx
import server_process
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, free_port

from kvflow.contract import INTERNAL_KEY_ENV

# Every worker of the router tests (the server tests' settings).
WORKER_FLAGS = ("--max-total-tokens", "6000", "--context-length", "2048")

# Fast health checks and short cooldowns, so faults show within a test's patience.
FAST_FAULTS = (
    "--health-interval-s",
    "0.3",
    "--health-timeout-s",
    "1",
    "--breaker-cooldown-s",
    "2",
    "--retry-initial-backoff-s",
    "0.01",
)


class RouterProcess:
    """``kvflow router --port <free> <flags>``; ``url`` is its base URL."""

    def __init__(self, *flags: str, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        full_env.pop("KVFLOW_API_KEY", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "kvflow",
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *flags,
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=full_env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"router did not start: {log.read_text()[-3000:]}")

    @staticmethod
    def admin_headers() -> dict[str, str]:
        """The credential of the admin routes when the router has the internal key (the
        environment it was started with), else none (loopback or the API key passes)."""
        key = os.environ.get(INTERNAL_KEY_ENV)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def workers(self, headers: dict[str, str] | None = None) -> dict[str, dict]:
        headers = self.admin_headers() if headers is None else headers
        listing = httpx.get(f"{self.url}/workers", headers=headers, timeout=10).json()
        return {w["url"]: w for w in listing["workers"]}

    def wait_for(self, predicate, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.workers()):
                return
            time.sleep(0.1)
        raise AssertionError(f"router never saw {what}: {self.workers()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_worker(*flags: str, log: Path, port: int | None = None) -> ServerProcess:
    """A ``kvflow serve`` worker (the server tests' helper); ``port`` pins its port (restarts)."""
    if port is None:
        return ServerProcess(*flags, log=log)
    with mock.patch.object(server_process, "free_port", lambda: port):
        return ServerProcess(*flags, log=log)


def worker_counter(url: str, name: str) -> float:
    """A counter summed over its labels, from the worker's own /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )
