"""Admission control: a concurrency limit with a bounded FIFO queue and a queue timeout."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from kvflow.runtime.router.config import AdmissionConfig
from kvflow.runtime.router.metrics import RouterMetrics
from kvflow.runtime.wire import RequestError

__all__ = ["Admission"]


class Admission:
    """``async with admission.slot():`` (or ``await acquire()`` ... ``release()``) holds one
    of ``max_concurrent`` slots.

    When all are taken the request waits in a FIFO of at most ``max_queued``; a full queue
    or a wait past ``queue_timeout_s`` raises ``RequestError(429)`` with ``Retry-After``.
    A slot freed by a finishing request passes straight to the oldest waiter.
    """

    def __init__(self, config: AdmissionConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _refuse(self, reason: str, message: str) -> RequestError:
        self.metrics.rejected.labels(reason).inc()
        return RequestError(429, message, {"Retry-After": str(self.config.retry_after_s)})

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue when none is free; each needs one
        :meth:`release`."""
        if self.active < self.config.max_concurrent and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.config.max_queued:
            raise self._refuse(
                "queue_full",
                f"router overloaded: {self.active} requests running and "
                f"{len(self._waiters)} queued (limits {self.config.max_concurrent} and "
                f"{self.config.max_queued})",
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.metrics.queue_length.set(len(self._waiters))
        start = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as err:
            if waiter.done() and not waiter.cancelled():
                # the slot was handed over just as we gave up: pass it on
                self.release()
            else:
                waiter.cancel()
                self._discard(waiter)
            if isinstance(err, asyncio.CancelledError):
                raise
            raise self._refuse(
                "queue_timeout",
                f"router overloaded: waited {self.config.queue_timeout_s:g}s for a slot",
            ) from None
        finally:
            self.metrics.queue_length.set(len(self._waiters))
            self.metrics.queue_wait.observe(time.monotonic() - start)
        # the releasing request handed its slot over: ``active`` already counts us

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with suppress(ValueError):
            self._waiters.remove(waiter)

    def release(self) -> None:
        """Give a slot back: to the oldest waiter, else to the pool."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; active unchanged
                self.metrics.queue_length.set(len(self._waiters))
                return
        self.active -= 1
