"""Processes the benchmark starts: each in its own session, logged to a file, bounded waits.

A process started here leads a new session, so its whole tree's CPU time is
``serving.session_cpu_seconds(proc.pid)`` and stopping it kills only that session.
Several processes start at once and are waited for together (four model servers load in
parallel instead of one after another).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["Launch", "Started", "started"]


@dataclass(frozen=True)
class Launch:
    """What to start: ``argv``, where it answers, and the GET path that means ready."""

    name: str
    argv: list[str]
    base_url: str
    ready_path: str = "/health"
    env: dict[str, str] | None = None


@dataclass(frozen=True)
class Started:
    """A running process: its launch, pid (= its session id) and log file."""

    launch: Launch
    pid: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.launch.base_url


def _tail(path: Path, lines: int = 30) -> str:
    return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])


def _wait_ready(procs: list[tuple[Started, subprocess.Popen]], timeout: float) -> None:
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending:
        for item in list(pending):
            started, proc = item
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{started.launch.name} exited with code {proc.returncode} before it was "
                    f"ready; log {started.log_path}:\n{_tail(started.log_path)}"
                )
            with suppress(httpx.HTTPError):
                url = started.base_url + started.launch.ready_path
                if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                    pending.remove(item)
        if pending and time.monotonic() > deadline:
            names = ", ".join(s.launch.name for s, _ in pending)
            raise TimeoutError(f"not ready after {timeout:.0f} s: {names}")
        if pending:
            time.sleep(0.5)


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL to the session this module started (leftovers only)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(10)


@contextmanager
def started(
    launches: list[Launch], log_dir: Path, ready_timeout: float = 300.0, grace: float = 15.0
) -> Iterator[list[Started]]:
    """Start every launch, yield once all are ready, stop them all on exit (also on errors)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[Started, subprocess.Popen]] = []
    try:
        for launch in launches:
            log_path = log_dir / f"{launch.name}.log"
            with open(log_path, "w") as log:
                log.write(" ".join(launch.argv) + "\n")
                log.flush()
                env = {**os.environ, **launch.env} if launch.env else None
                proc = subprocess.Popen(
                    launch.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=env,
                )
            procs.append((Started(launch, proc.pid, log_path), proc))
        _wait_ready(procs, ready_timeout)
        yield [s for s, _ in procs]
    finally:
        for _, proc in procs:
            _stop(proc, grace)
