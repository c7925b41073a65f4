"""Environment knobs of the runtime, each declared once, typed and prefixed ``KVFLOW_``."""

from __future__ import annotations

import os
from pathlib import Path

from kvflow.contract import MODEL_CACHE_ENV

__all__ = ["cache_dir", "cpu_decode_graph"]


def cache_dir() -> Path:
    """Root of kvflow's caches (converted models, built binaries): ``$KVFLOW_CACHE_DIR``."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "kvflow")


def cpu_decode_graph() -> bool:
    """Whether CPU decode steps may run as one native call (:mod:`kvflow.runtime.cpu_graph`):
    on unless ``$KVFLOW_CPU_DECODE_GRAPH`` is ``0``."""
    return os.environ.get("KVFLOW_CPU_DECODE_GRAPH", "1") != "0"
