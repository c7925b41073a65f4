"""kvflow: a Kubernetes operator plus an SGLang-style serving runtime.

Importing ``kvflow`` is cheap and torch-free; ``kvflow.Engine`` loads the runtime lazily.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "__version__"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvflow.runtime.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from kvflow.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
