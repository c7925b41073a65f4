"""Package surfaces whose heavy names load on first use (PEP 562).

A package's ``__init__`` keeps its ``__all__``; the names whose modules import torch,
triton or numpy come from a table and load on first access, so importing the package for
a light name (a registry's choices, a flag's values) stays light: the HTTP process of
``kvflow serve`` never imports torch (``tests/server/test_serve_imports.py``). Static
checkers read the same names from an ``if TYPE_CHECKING:`` import block.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: dict[str, tuple[str, ...]], submodules: tuple[str, ...] = ()
) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``modules`` maps a module (relative to the
    package, as ``".base"``) to the names it gives the package; ``submodules`` are modules
    the package gives by their own name (``cpu.gemm``).

    NOTE: loading a module binds every name it gives, not only the one asked for: importing
    a submodule sets the package attribute of its own name (``kvflow.kernels.gemv``), which
    must end up the function of that name, as the eager import left it."""
    names = {name: module for module, given in modules.items() for name in given}

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")  # binds itself
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module, package)
        namespace = sys.modules[package].__dict__
        for given in modules[module]:
            namespace[given] = getattr(loaded, given)
        return namespace[name]

    return __getattr__
