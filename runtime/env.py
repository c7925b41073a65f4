"""Environment knobs of the runtime, each declared once, typed and prefixed ``KVFLOW_``."""

from __future__ import annotations

import os
from pathlib import Path

from kvflow.contract import MODEL_CACHE_ENV

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Root of kvflow's caches (converted models, built binaries): ``$KVFLOW_CACHE_DIR``."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "kvflow")
