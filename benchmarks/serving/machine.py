"""What the results were measured on: CPU, cores, GPU, load, package versions, commit."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata

__all__ = ["load_average", "machine_info"]

_PACKAGES = ("torch", "transformers", "tokenizers", "httpx", "fastapi", "uvicorn")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> str:
    if not shutil.which("nvidia-smi"):
        return "none"
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return ", ".join(line.strip() for line in out.splitlines() if line.strip()) or "none"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (
        " (with uncommitted changes)"
        if git("status", "--porcelain", "--untracked-files=no")
        else ""
    )


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, str]:
    """Facts about this machine and software, for the results header."""
    info = {
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "gpu": _gpus(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "kvflow commit": _commit(),
    }
    info.update({package: _version(package) for package in _PACKAGES})
    return info
