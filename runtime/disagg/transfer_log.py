"""What the prefill's KV writes cost: counts, bytes and seconds since start, and the last
few writes one by one (for a latency histogram on the HTTP side)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from kvflow.runtime.disagg.plan import SlotPlan

__all__ = ["TimedWrite", "TransferLog", "TransferTotals", "timed_write"]

_RECENT = 128  # more than a 0.25 s stats interval ever sees finish


class TimedWrite(NamedTuple):
    """One request's KV write as the sender thread saw it."""

    seconds: float
    nbytes: int


class TransferTotals(NamedTuple):
    """Totals since start. ``recent`` holds the last writes (oldest first), so a reader that
    remembers ``writes`` takes the ``writes - last_writes`` newest of them."""

    writes: int = 0
    failures: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    recent: tuple[TimedWrite, ...] = ()
    retries: int = 0  # transport calls repeated (set by the role from its transport)


def timed_write(write: Callable[[str, SlotPlan], None], session: str, plan: SlotPlan) -> TimedWrite:
    """Run ``write(session, plan)`` and time it (on the sender thread: the clock covers the
    transport alone, not the wait for a free sender)."""
    start = time.perf_counter()
    write(session, plan)
    return TimedWrite(time.perf_counter() - start, plan.nbytes)


class TransferLog:
    """Accumulates :class:`TimedWrite` results; used from the scheduler thread only."""

    def __init__(self) -> None:
        self._count = self._failures = self._nbytes = 0
        self._seconds = 0.0
        self._recent: deque[TimedWrite] = deque(maxlen=_RECENT)

    def record(self, done: TimedWrite) -> None:
        self._count += 1
        self._nbytes += done.nbytes
        self._seconds += done.seconds
        self._recent.append(done)

    def record_failure(self) -> None:
        self._failures += 1

    def totals(self) -> TransferTotals:
        return TransferTotals(
            self._count, self._failures, self._nbytes, self._seconds, tuple(self._recent)
        )
