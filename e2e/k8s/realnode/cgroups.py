"""The node's own cgroup subtree: created before the kubelet starts, emptied and removed
after it stops. Every container process of the node lives somewhere below it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["create_cgroup_root", "kill_cgroup_processes", "remove_cgroup_root"]

_CGROUP_FS = Path("/sys/fs/cgroup")


def _hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, named ones, v2)."""
    points = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            fs_type = fields[fields.index("-") + 1]
            if fs_type in ("cgroup", "cgroup2"):
                points.append(Path(fields[4]))
    return points or [_CGROUP_FS]


def create_cgroup_root(root: str) -> None:
    """Create `root` in every hierarchy (the kubelet refuses a cgroupRoot that does not
    exist); cpuset children start with no CPUs or memory nodes, so copy the parent's."""
    for hierarchy in _hierarchies():
        path = hierarchy / root.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            own = path / knob
            if own.exists() and not own.read_text().strip():
                own.write_text((path.parent / knob).read_text())


def _pids(root: str) -> set[int]:
    found: set[int] = set()
    for hierarchy in _hierarchies():
        base = hierarchy / root.lstrip("/")
        if not base.is_dir():
            continue
        for dirpath, _, filenames in os.walk(base):
            if "cgroup.procs" in filenames:
                try:
                    text = (Path(dirpath) / "cgroup.procs").read_text()
                except OSError:
                    continue
                found.update(int(p) for p in text.split())
    return found


def kill_cgroup_processes(root: str, timeout_s: float = 10.0) -> int:
    """SIGKILL every process below `root` until none is left; return how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while pids := _pids(root):
        for pid in pids - {os.getpid()}:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} in cgroup {root} survive SIGKILL")
        time.sleep(0.1)
    return len(killed)


def remove_cgroup_root(root: str) -> None:
    """Remove `root` and its children (bottom-up) from every hierarchy."""
    for hierarchy in _hierarchies():
        base = hierarchy / root.lstrip("/")
        if not base.is_dir():
            continue
        for dirpath, _, _ in sorted(os.walk(base), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
