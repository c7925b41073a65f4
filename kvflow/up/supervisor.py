"""Runs a :class:`~.plan.LocalPlan`: start in stages, wait for health, restart, stop.

Each process runs in its own session (hence process group), so stopping it reaches every
process it spawned (``kvflow serve``'s scheduler and detokenizer) and a terminal's Ctrl-C
reaches only ``kvflow up``, which then stops them in reverse order: SIGTERM to each group
(a worker drains its in-flight requests), SIGKILL to what is left after the grace period.
Output goes to ``<log_dir>/<name>.log`` and, prefixed with ``[name]``, to the console.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .plan import LOOPBACK, LocalPlan, LocalProcess

STOP_GRACE_S = 40.0  # a worker drains in-flight requests for up to 30 s
POLL_S = 0.5
USAGE_ERROR = 2  # argparse's exit status: the command itself is refused


class RoleFailed(RuntimeError):
    """A process that cannot be kept running (refused flags, restarts used up, too slow)."""


class Console:
    """Lines from many threads, whole and prefixed."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, text: str, prefix: str = "kvflow up") -> None:
        with self._lock:
            self._stream.write(f"[{prefix}] {text}\n")
            self._stream.flush()


class RoleProcess:
    """One planned process and its restarts."""

    def __init__(self, spec: LocalProcess, log_dir: Path, console: Console) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self._console = console
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.was_healthy = False
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        env = {**os.environ, **self.spec.env}
        self.proc = subprocess.Popen(
            self.spec.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._pump = threading.Thread(target=self._copy_output, args=(self.proc,), daemon=True)
        self._pump.start()

    def _copy_output(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with self.log_path.open("ab") as log:
            for raw in proc.stdout:
                log.write(raw)
                log.flush()
                self._console.line(raw.decode(errors="replace").rstrip("\n"), self.spec.name)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        health = self.spec.health
        try:
            if health.path is None:
                with socket.create_connection((LOOPBACK, health.port), timeout=2):
                    return True
            with urllib.request.urlopen(health.url, timeout=2) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, deadline: float) -> None:
        """SIGTERM the group, wait until ``deadline``, then SIGKILL what is left of it."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        self.signal_group(signal.SIGKILL)  # the group's stragglers too, even if it exited
        self.proc.wait()
        if self._pump is not None:
            self._pump.join(5)

    def tail(self, lines: int = 15) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class Supervisor:
    """Starts the plan, keeps it running until ``stop`` is set, then stops everything."""

    def __init__(
        self, plan: LocalPlan, log_dir: Path, console: Console, max_restarts: int = 3
    ) -> None:
        self.plan = plan
        self.console = console
        self.max_restarts = max_restarts
        self.roles = [RoleProcess(p, log_dir, console) for p in plan.processes]

    def start(self, stop: threading.Event) -> bool:
        """Start stage by stage; True once every process is healthy, False if stopped."""
        for stage in sorted({role.spec.stage for role in self.roles}):
            members = [role for role in self.roles if role.spec.stage == stage]
            for role in members:
                self.console.line(f"starting {role.spec.name} (log: {role.log_path})")
                role.start()
            deadline = time.monotonic() + max(role.spec.start_timeout_s for role in members)
            while not all(role.was_healthy for role in members):
                if stop.wait(POLL_S):
                    return False
                self.check(members)
                for role in members:
                    if not role.was_healthy and role.exit_code is None and role.healthy():
                        role.was_healthy = True
                        self.console.line(f"{role.spec.name} healthy at {role.spec.health.url}")
                if time.monotonic() > deadline:
                    slow = [r.spec.name for r in members if not r.was_healthy]
                    raise RoleFailed(f"not healthy in time: {', '.join(slow)}")
        return True

    def check(self, roles: list[RoleProcess] | None = None) -> None:
        """Restart exited processes (raises :class:`RoleFailed` when one cannot be kept up)."""
        for role in roles or self.roles:
            code = role.exit_code
            if code is None:
                continue
            name = role.spec.name
            role.signal_group(signal.SIGKILL)  # what it spawned must not outlive it
            if code == USAGE_ERROR and not role.was_healthy:
                raise RoleFailed(f"{name} refused its command (exit 2):\n{role.tail()}")
            if role.restarts >= self.max_restarts:
                raise RoleFailed(
                    f"{name} exited with code {code}; gave up after {role.restarts} "
                    f"restarts:\n{role.tail()}"
                )
            role.restarts += 1
            role.was_healthy = False
            self.console.line(
                f"{name} exited with code {code}; restarting "
                f"({role.restarts}/{self.max_restarts}, log: {role.log_path})"
            )
            role.start()

    def watch(self, stop: threading.Event, on_healthy: Callable[[RoleProcess], None]) -> None:
        """Keep every process running until ``stop`` is set."""
        while not stop.wait(POLL_S):
            self.check()
            for role in self.roles:
                if not role.was_healthy and role.exit_code is None and role.healthy():
                    role.was_healthy = True
                    on_healthy(role)

    def shutdown(self) -> None:
        """Stop every process, the router first, the Mooncake master last."""
        deadline = time.monotonic() + STOP_GRACE_S
        ordered = sorted(self.roles, key=lambda r: -r.spec.stage)
        for role in ordered:
            if role.proc is not None and role.exit_code is None:
                self.console.line(f"stopping {role.spec.name}")
                role.signal_group(signal.SIGTERM)
        for role in ordered:
            role.stop(deadline)
