"""Exponential backoff with jitter, bounded by a retry count and a total time budget."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvflow.runtime.router.config import RetryConfig

__all__ = ["RetryBudget", "backoff_delay"]


def backoff_delay(
    retry: int, config: RetryConfig, rand: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before retry number ``retry`` (0-based).

    The base doubles from ``initial_backoff_s`` up to ``max_backoff_s``; a ``jitter``
    fraction of it is drawn at random, so the delay lies in ``[base * (1 - jitter), base]``.
    """
    base = min(config.max_backoff_s, config.initial_backoff_s * (2**retry))
    return base * (1.0 - config.jitter * rand())


class RetryBudget:
    """What one request may still spend on retries: a count and a deadline."""

    def __init__(
        self,
        config: RetryConfig,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self._clock = clock
        self._rand = rand
        self._deadline = clock() + config.budget_s
        self.retries = 0

    def next_delay(self) -> float | None:
        """The wait before the next retry, or ``None`` when the count or the time is spent.

        Counts the retry: call it once per retry actually made.
        """
        if self.retries >= self.config.max_retries:
            return None
        delay = backoff_delay(self.retries, self.config, self._rand)
        if self._clock() + delay > self._deadline:
            return None
        self.retries += 1
        return delay
