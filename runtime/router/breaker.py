"""A circuit breaker per worker: closed -> open -> half-open -> closed."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

from kvflow.runtime.router.config import BreakerConfig

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def level(self) -> int:
        """The metric's value: 0 closed, 1 half-open, 2 open."""
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


class CircuitBreaker:
    """Counts consecutive request failures of one worker.

    ``failure_threshold`` consecutive failures open it; after ``cooldown_s`` it is half-open
    and :meth:`allows` lets one probe through per cooldown period; a success closes it, a
    failure re-opens it. ``on_transition(old, new)`` is called on every state change.
    Not thread-safe: used from the event loop only.
    """

    def __init__(
        self,
        config: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._on_transition = on_transition
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._opened_at = 0.0
        self._probe_at = float("-inf")

    def allows(self) -> bool:
        """Whether a request may go to the worker now (takes the half-open probe slot)."""
        if self.state is BreakerState.CLOSED:
            return True
        now = self._clock()
        if self.state is BreakerState.OPEN:
            if now - self._opened_at < self.config.cooldown_s:
                return False
            self._move(BreakerState.HALF_OPEN)
        # NOTE: a probe whose outcome is never recorded (client gone) frees its slot after a
        # cooldown, so a half-open worker cannot be stuck.
        if now - self._probe_at < self.config.cooldown_s:
            return False
        self._probe_at = now
        return True

    def peek(self) -> bool:
        """Like :meth:`allows` without taking the probe slot (for listings and selection)."""
        if self.state is BreakerState.CLOSED:
            return True
        now = self._clock()
        if self.state is BreakerState.OPEN:
            return now - self._opened_at >= self.config.cooldown_s
        return now - self._probe_at >= self.config.cooldown_s

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.state is not BreakerState.CLOSED:
            self._move(BreakerState.CLOSED)

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED
            and self.consecutive_failures >= self.config.failure_threshold
        ):
            self._opened_at = self._clock()
            self._move(BreakerState.OPEN)

    def _move(self, new: BreakerState) -> None:
        old, self.state = self.state, new
        if new is BreakerState.HALF_OPEN:
            self._probe_at = float("-inf")
        if self._on_transition is not None:
            self._on_transition(old, new)
