"""A real ``kvflow serve`` process (HTTP + scheduler + detokenizer) for tests."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 240


def _fixed_ports() -> range:
    """Ports below the kernel's ephemeral range: a port a process takes with bind(0) (the
    runtime's rendezvous stores, gloo, every outgoing connection) is never one of them, so
    one picked here stays free until its server binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(20000, max(low, 20001))


def free_port() -> int:
    """A loopback port free a moment ago, outside the ephemeral range: a port from bind(0),
    released and handed to a PD server at TP 2 that binds it after loading, was taken
    meanwhile by some other bind(0) or connection ('address already in use' once in CI)."""
    ports = _fixed_ports()
    for _ in range(500):
        port = random.choice(ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1}")


def processes_left(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Of ``pids``, those still running (zombies aside) after waiting up to ``timeout`` s."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def assert_refused_at_start(flags: list[str], message: str) -> None:
    """``kvflow serve`` with ``flags`` refuses before starting anything: exit 2, one line
    saying ``message``, no traceback."""
    done = subprocess.run(
        [sys.executable, "-P", "-m", "kvflow", "serve", "--port", "1", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def float32_on_cpu(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` with ``--dtype float32`` first when they name no dtype and no GPU is here:
    the references test servers are compared with (transformers, ``make_engine``) run
    float32, while the CPU default is bfloat16 on CPUs with native bf16 (checked against
    transformers by tests/runtime/test_cpu_dtype.py)."""
    import torch

    if "--dtype" in flags or torch.cuda.is_available():
        return flags
    return ("--dtype", "float32", *flags)


class ServerProcess:
    """A server started with extra flags (float32 on CPU unless they name a dtype:
    `float32_on_cpu`); ``url`` is its base URL."""

    def __init__(self, *flags: str, log: Path, env: dict[str, str] | None = None) -> None:
        flags = float32_on_cpu(flags)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvflow", "serve", "--port", str(self.port), *flags],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")

    def headers(self, api_key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def server_info(self, api_key: str | None = None) -> dict:
        return httpx.get(
            f"{self.url}/get_server_info", headers=self.headers(api_key), timeout=30
        ).json()

    def wait_idle_and_free(self, api_key: str | None = None, timeout: float = 60) -> dict:
        """Wait until nothing is in flight and no request holds KV memory (the leak check)."""
        deadline = time.monotonic() + timeout
        info = {}
        while time.monotonic() < deadline:
            info = self.server_info(api_key)
            stats = info["stats"]
            if (
                info["in_flight_requests"] == 0
                and stats["kv_request_tokens"] == 0
                and stats.get("spec_draft_kv_tokens", 0) == 0
                and stats["free_request_rows"] == stats["total_request_rows"]
                and stats["num_running_reqs"] == 0
                and stats["num_queue_reqs"] == 0
            ):
                return info
            time.sleep(0.2)
        raise AssertionError(f"server not idle with free KV memory: {info}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
