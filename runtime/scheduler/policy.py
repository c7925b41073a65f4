"""Order of the waiting queue: ``lpm`` (longest cached prefix first) or ``fcfs``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.runtime.core import Req

__all__ = ["SCHEDULE_POLICIES", "order_waiting"]

SCHEDULE_POLICIES = ("lpm", "fcfs")
# Matching every waiting prompt against the tree costs time; past this many waiting
# requests lpm falls back to fcfs.
LPM_MAX_QUEUE = 128
# Under lpm, a request that has waited this long goes ahead of every cache hit (oldest
# first): without it, a stream of requests that hit the cache starves one that does not.
LPM_MAX_WAIT_S = 5.0


def order_waiting(
    policy: str,
    waiting: list[Req],
    match_len: Callable[[Req], int],
    now: float | None = None,
) -> list[Req]:
    """The order in which waiting requests are offered to the prefill adder.

    Retracted requests go first under every policy: they already made progress. Under
    lpm, requests waiting over :data:`LPM_MAX_WAIT_S` (at ``now``, monotonic seconds) come
    next in arrival order, then the rest by cached prefix length.
    """
    if policy not in SCHEDULE_POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r}; choose from {SCHEDULE_POLICIES}")
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: (r.retractions == 0,))
    now = time.monotonic() if now is None else now
    starved = {r.rid for r in waiting if now - r.created_at > LPM_MAX_WAIT_S}
    lengths = {r.rid: match_len(r) for r in waiting if r.rid not in starved}

    def key(r: Req) -> tuple[bool, bool, float]:
        if r.rid in starved:
            return (r.retractions == 0, False, r.created_at)
        return (r.retractions == 0, True, -lengths[r.rid])

    return sorted(waiting, key=key)
