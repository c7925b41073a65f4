"""The kvflow operator as a real process (``python -m kvflow operator``) against a test
cluster, with its liveness endpoint and its log; used by test_operator*.py and
test_chart*.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvflow import contract

__all__ = ["OperatorProcess", "service_account_kubeconfig"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OperatorProcess:
    """One operator process; ``start`` waits until its liveness endpoint answers."""

    def __init__(
        self,
        env: dict[str, str],
        namespaces: Sequence[str],
        log_path: Path,
        drift_interval: float = 5.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.env = env
        self.extra_args = list(extra_args)
        self.namespaces = list(namespaces)
        self.log_path = log_path
        self.drift_interval = drift_interval
        self.health_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}{contract.OPERATOR_HEALTH_PATH}"

    def start(self, timeout: float = 60.0) -> None:
        argv = [sys.executable, "-m", "kvflow", "operator", "--health-host", "127.0.0.1"]
        argv += [
            "--health-port",
            str(self.health_port),
            "--drift-interval",
            str(self.drift_interval),
        ]
        for namespace in self.namespaces:
            argv += ["--namespace", namespace]
        argv += self.extra_args
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"operator exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"operator not healthy after {timeout}s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no clean-up handlers run, as when a node dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def service_account_kubeconfig(admin: dict[str, object], token: str, path: Path) -> Path:
    """A kubeconfig for the same cluster as ``admin`` (``kubectl config view --raw --minify
    -o json``) that authenticates with a ServiceAccount token."""
    cluster = admin["clusters"][0]  # type: ignore[index]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": "sa"}}],
        "current-context": "sa",
    }
    path.write_text(json.dumps(config))
    return path
