"""A costly resource (servers) shared by consecutive tests instead of started per module.

A conftest makes one :class:`Shared` in a session fixture (``with shared:`` around its
yield), hands its value out through a module-scoped fixture, and calls
:func:`stop_unwanted` from ``pytest_runtest_teardown``: each live resource stops once the
next test no longer wants it, so it never stays in memory beside later directories'
servers, and a later user simply starts it again.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

import pytest

T = TypeVar("T")

_LIVE: list[Shared[Any]] = []  # entered and not yet exited


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

    def __enter__(self) -> Shared[T]:
        _LIVE.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _LIVE.remove(self)
        self.stop()


def stop_unwanted(nextitem: pytest.Item | None) -> None:
    """For ``pytest_runtest_teardown`` (``trylast``, after the test's own fixtures are torn
    down): every live resource the next test does not want is stopped."""
    for shared in _LIVE:
        shared.after(nextitem)
