"""Environment knobs of the runtime, each declared once, typed and prefixed ``KVFLOW_``."""

from __future__ import annotations

import os
from pathlib import Path

from kvflow.contract import MODEL_CACHE_ENV

__all__ = ["cache_dir", "cpu_decode_graph", "lora_shrink_stream"]


def cache_dir() -> Path:
    """Root of kvflow's caches (converted models, built binaries): ``$KVFLOW_CACHE_DIR``."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "kvflow")


def cpu_decode_graph() -> bool:
    """Whether CPU decode steps may run as one native call (:mod:`kvflow.runtime.cpu_graph`):
    on unless ``$KVFLOW_CPU_DECODE_GRAPH`` is ``0``."""
    return os.environ.get("KVFLOW_CPU_DECODE_GRAPH", "1") != "0"


def lora_shrink_stream() -> bool:
    """Whether CUDA LoRA layers capture their shrink on a second stream in the decode CUDA
    graphs, beside the base projection (:class:`kvflow.runtime.lora.layers.LoraLinear`):
    on unless ``$KVFLOW_LORA_SHRINK_STREAM`` is ``0`` (for measuring what it buys)."""
    return os.environ.get("KVFLOW_LORA_SHRINK_STREAM", "1") != "0"
