"""One control-plane component as a child process with its own log file."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["Component", "ComponentError"]


class ComponentError(RuntimeError):
    """A component exited or did not become healthy; the message carries its log tail."""


class Component:
    """A long-running binary: started once, probed until healthy, stopped once.

    The child runs in its own session so that a Ctrl-C in the terminal reaches only
    the harness, which then stops the components in reverse start order. On Linux it
    also gets SIGTERM when the harness dies without cleaning up (a killed pytest),
    so no etcd or apiserver outlives it.
    """

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, healthy: Callable[[], bool]
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._healthy = healthy
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll the health probe until it passes; raise `ComponentError` if the process
        exits first or `timeout_s` runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            exit_code = self._proc.poll() if self._proc else None
            if exit_code is not None:
                raise ComponentError(self._failure(f"exited with code {exit_code}"))
            if self._healthy():
                return
            if time.monotonic() > deadline:
                raise ComponentError(self._failure(f"not healthy after {timeout_s:g}s"))
            time.sleep(0.2)

    def check_running(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise ComponentError(self._failure(f"exited with code {self._proc.returncode}"))

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; always reaps the child."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _failure(self, what: str) -> str:
        return f"{self.name} {what}; last lines of {self.log_path}:\n{self.log_tail()}"


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: ask the kernel for SIGTERM when the parent exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
