"""What every benchmark script's command line shares: the embedded model's folder and the
comma-separated integer lists of its flags."""

from __future__ import annotations

from kvflow.runtime.env import cache_dir
from kvflow.runtime.models import EMBEDDED_MODEL_NAME

__all__ = ["EMBEDDED_MODEL", "int_list"]

# Where `make setup` / the first server start converts the embedded model ($KVFLOW_CACHE_DIR).
EMBEDDED_MODEL = cache_dir() / "models" / EMBEDDED_MODEL_NAME


def int_list(text: str) -> tuple[int, ...]:
    """``"1,32,256"`` -> ``(1, 32, 256)`` (an argparse ``type``)."""
    return tuple(int(item) for item in text.split(",") if item)
