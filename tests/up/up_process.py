"""A ``kvflow up`` process for tests: its console, its descendants, Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc's children lists, threads included)."""
    found: set[int] = set()
    stack = [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    stack.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids that still exist and are not zombies."""
    living = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            living.add(pid)
    return living


class UpProcess:
    """``kvflow up -f FILE --port PORT --state-dir DIR``, its console collected line by line."""

    def __init__(self, spec: Path, port: int, state_dir: Path) -> None:
        argv = [sys.executable, "-P", "-m", "kvflow", "up", "-f", str(spec), "--port", str(port)]
        argv += ["--state-dir", str(state_dir), "--max-restarts", "2"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KVFLOW_API_KEY", None)
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """The first console line from index ``start`` on matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[start:]:
                match = re.search(pattern, line)
                if match:
                    return match
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.2)
        tail = "\n".join(self.lines[-60:])
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{tail}")

    def interrupt(self, timeout: float = 90) -> int:
        """Ctrl-C: SIGINT to ``kvflow up`` alone; its exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in descendants(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
