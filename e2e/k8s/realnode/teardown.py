"""Everything a real node leaves behind that stopping containerd does not remove: shim
processes, mounts (overlay roots, sandbox /dev/shm, volumes, network namespaces)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
from pathlib import Path

from .config import RealNodeConfig
from .containerd import ctr

__all__ = ["kill_shims", "mounts_under", "sandbox_netns_paths", "unmount_under"]

_MNT_DETACH = 2


def sandbox_netns_paths(cfg: RealNodeConfig) -> list[Path]:
    """Network namespace files of the node's pod sandboxes (pods without host networking
    get one under /var/run/netns); asked before containerd stops."""
    listed = ctr(cfg, "containers", "ls", "-q", check=False, timeout=30)
    paths = []
    for container in listed.stdout.split():
        info = ctr(cfg, "containers", "info", container, check=False, timeout=30)
        try:
            namespaces = json.loads(info.stdout)["Spec"]["linux"]["namespaces"]
        except (ValueError, KeyError, TypeError):
            continue
        paths += [
            Path(n["path"]) for n in namespaces if n.get("type") == "network" and n.get("path")
        ]
    return paths


def kill_shims(cfg: RealNodeConfig) -> list[int]:
    """SIGKILL the containerd shims that serve this node (their argv names its socket);
    they outlive containerd by design. Returns their pids."""
    socket = str(cfg.containerd_socket)
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and socket.encode() in argv:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                pids.append(int(proc.name))
            except ProcessLookupError:
                pass
    return pids


def _mount_points() -> list[Path]:
    points = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            raw = line.split()[4]
            points.append(Path(raw.encode().decode("unicode_escape")))
    return points


def mounts_under(root: Path) -> list[Path]:
    """The mount points at or below `root`."""
    resolved = root.resolve()
    return [p for p in _mount_points() if p == resolved or resolved in p.parents]


def unmount_under(*roots: Path) -> list[Path]:
    """Lazily unmount every mount at or below `roots`, deepest first; return them."""
    libc = ctypes.CDLL(None, use_errno=True)
    resolved = [r.resolve() for r in roots]
    targets = [
        point
        for point in _mount_points()
        if any(point == root or root in point.parents for root in resolved)
    ]
    done = []
    for point in sorted(set(targets), key=lambda p: -len(p.parts)):
        if libc.umount2(str(point).encode(), _MNT_DETACH) == 0:
            done.append(point)
    return done
