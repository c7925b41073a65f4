"""The contract every way of obtaining binaries (download, wheel, source build) meets."""

from __future__ import annotations

import platform
import subprocess
from abc import ABC, abstractmethod
from pathlib import Path

__all__ = ["BinarySource", "SourceUnavailable", "go_arch", "version_output"]


class SourceUnavailable(Exception):
    """This source cannot serve here (no network, no go, a failed build); try the next."""


class BinarySource(ABC):
    """One way of obtaining some of the Kubernetes binaries.

    `fetch` writes executables named exactly as requested into `staging` (a fresh
    directory on the cache's file system) and returns the ones it wrote, which may
    be fewer than asked for. It raises `SourceUnavailable` when it cannot serve at
    all; the resolver then tries the next source with whatever is still missing.
    """

    label: str
    provides: frozenset[str]

    @abstractmethod
    def fetch(self, names: frozenset[str], staging: Path) -> dict[str, Path]: ...


def go_arch() -> str:
    """This machine's architecture in Go's spelling (`amd64`, `arm64`)."""
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def version_output(binary: Path, *args: str) -> str:
    """What `binary <args>` prints (stdout and stderr), for a sanity check after fetching."""
    done = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=30, check=False
    )
    return done.stdout + done.stderr
