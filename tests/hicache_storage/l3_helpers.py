"""Helpers of the L3 storage tests: page contents, free ports, a mooncake_master process."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PAGE_BYTES = 16 * 1024


def page_bytes(key: str, seed: int = 0, nbytes: int = PAGE_BYTES) -> np.ndarray:
    """Deterministic pseudo-random page content for ``key`` (``seed`` tells writers apart)."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mooncake_installed() -> bool:
    return importlib.util.find_spec("mooncake") is not None and master_binary() is not None


def master_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "mooncake_master"
    if beside_python.exists():
        return str(beside_python)
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin:
        in_package = Path(spec.origin).parent / "mooncake_master"
        if in_package.exists():
            return str(in_package)
    return shutil.which("mooncake_master")


def wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


class MooncakeMaster:
    """A real ``mooncake_master`` with its HTTP metadata server, on free loopback ports."""

    def __init__(self, log: Path, rpc_port: int = 0, metadata_port: int = 0) -> None:
        self.rpc_port = rpc_port or free_port()
        self.metadata_port = metadata_port or free_port()
        self.metrics_port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def start(self) -> None:
        binary = master_binary()
        assert binary is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--rpc_port={self.rpc_port}",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={self.metadata_port}",
                    # Its own metrics port: the default 9003 collides with any other master
                    # running on this machine (the master then exits at start).
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    "--rpc_address=127.0.0.1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_port(self.rpc_port, 20)
        wait_port(self.metadata_port, 20)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def run_python(code: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this venv (``-P``: the repo's operator/ folder
    must not shadow Python's operator module), with this folder importable."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run(
        [sys.executable, "-P", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
