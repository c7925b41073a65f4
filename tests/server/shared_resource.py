"""A costly resource (servers) shared by consecutive tests instead of started per module.

A conftest holds one :class:`Shared` in a session fixture, hands its value out through a
module-scoped fixture, and stops it from ``pytest_runtest_teardown`` once the next test
no longer wants it (:meth:`Shared.after`): it never stays in memory beside later
directories' servers, and a later user simply starts it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import pytest

T = TypeVar("T")


class Shared(Generic[T]):
    """``start()`` returns the value and the function that stops it; ``wanted(item)`` says
    whether a test (the next one) uses it."""

    def __init__(
        self,
        start: Callable[[], tuple[T, Callable[[], object]]],
        wanted: Callable[[pytest.Item], bool],
    ) -> None:
        self._start = start
        self._wanted = wanted
        self._running: tuple[T, Callable[[], object]] | None = None

    def get(self) -> T:
        if self._running is None:
            self._running = self._start()
        return self._running[0]

    def stop(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running[1]()

    def after(self, nextitem: pytest.Item | None) -> None:
        """Called after each test's teardown: stop unless the next test wants it."""
        if nextitem is None or not self._wanted(nextitem):
            self.stop()
