"""kvflow's serving runtime. ``Engine`` is the in-process entry point (imported lazily)."""

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "EngineConfig", "SamplingParams"]

if TYPE_CHECKING:
    from kvflow.runtime.config import EngineConfig
    from kvflow.runtime.engine import Engine
    from kvflow.runtime.sampling import SamplingParams

_LAZY = {
    "Engine": "kvflow.runtime.engine",
    "EngineConfig": "kvflow.runtime.config",
    "SamplingParams": "kvflow.runtime.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvflow.runtime' has no attribute {name!r}")
