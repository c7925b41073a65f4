"""Progress lines for slow steps (a cold build takes many minutes)."""

from __future__ import annotations

import sys
import time

__all__ = ["elapsed", "say"]


def say(message: str) -> None:
    """Print one progress line to stderr, where pytest's `-s` and the CLI both show it."""
    print(f"[kvflow-k8s] {message}", file=sys.stderr, flush=True)


def elapsed(start: float) -> str:
    """`12.3s` since `start` (a `time.monotonic()` value)."""
    return f"{time.monotonic() - start:.1f}s"
