"""Whether this machine can run a real node, and if not, exactly why."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["CNI_BIN_DIR", "DEBIAN_PACKAGES", "missing_capability"]

CNI_BIN_DIR = Path("/usr/lib/cni")
# What scripts/setup.sh installs for the real node.
DEBIAN_PACKAGES = "containerd runc containernetworking-plugins umoci iptables gcc libc6-dev"
_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "umoci", "gcc")
_CGROUP_V1 = Path("/sys/fs/cgroup")
_CONTROLLERS = ("cpu", "memory", "pids", "cpuset", "devices", "freezer")


def missing_capability() -> str | None:
    """None when a real node can start here; otherwise the first reason it cannot.

    Checks what the node needs before anything starts: root (containerd and the kubelet
    mount, create namespaces and cgroups), the Debian packages, a loopback CNI plugin,
    static linking for the pause binary, and writable cgroups (v1 with the controllers
    the kubelet uses, or a v2 unified hierarchy).
    """
    if os.geteuid() != 0:
        return "a real node needs root (containerd and the kubelet create mounts and cgroups)"
    missing = [c for c in _COMMANDS if shutil.which(c) is None]
    if missing:
        return f"missing {', '.join(missing)}: install Debian's {DEBIAN_PACKAGES} (make setup)"
    if not (CNI_BIN_DIR / "loopback").is_file():
        return f"no CNI loopback plugin in {CNI_BIN_DIR} (Debian containernetworking-plugins)"
    if not Path("/usr/lib/x86_64-linux-gnu/libc.a").exists() and not list(
        Path("/usr/lib").glob("*/libc.a")
    ):
        return "no static libc (libc.a) for the pause binary: install Debian's libc6-dev"
    return _cgroup_problem()


def _cgroup_problem() -> str | None:
    if (_CGROUP_V1 / "cgroup.controllers").is_file():
        return None if os.access(_CGROUP_V1, os.W_OK) else "the cgroup v2 tree is read-only"
    for controller in _CONTROLLERS:
        path = _CGROUP_V1 / controller
        if not path.is_dir():
            return f"cgroup v1 controller {controller} is not mounted at {path}"
        if not os.access(path, os.W_OK):
            return f"cgroup v1 controller {controller} ({path}) is read-only"
    return None
