"""A small registry of named, lazily imported factories for pluggable parts."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to ``"module:attribute"``; the module is imported on first :meth:`get`.

    The CLI lists :meth:`choices` so an unknown name fails at parse time, not at start-up.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._targets: dict[str, str] = {}

    def register(self, name: str, target: str) -> None:
        if name in self._targets:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._targets[name] = target

    def choices(self) -> list[str]:
        return sorted(self._targets)

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._targets:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {self.choices()}")
        module, _, attr = self._targets[name].partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
