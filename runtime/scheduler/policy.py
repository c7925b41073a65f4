"""Order of the waiting queue: ``lpm`` (longest cached prefix first) or ``fcfs``."""

from __future__ import annotations

from collections.abc import Callable

from kvflow.runtime.scheduler.req import Req

__all__ = ["SCHEDULE_POLICIES", "order_waiting"]

SCHEDULE_POLICIES = ("lpm", "fcfs")
# Matching every waiting prompt against the tree costs time; past this many waiting
# requests lpm falls back to fcfs.
LPM_MAX_QUEUE = 128


def order_waiting(policy: str, waiting: list[Req], match_len: Callable[[Req], int]) -> list[Req]:
    """The order in which waiting requests are offered to the prefill adder.

    Retracted requests go first under every policy: they already made progress.
    """
    if policy not in SCHEDULE_POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r}; choose from {SCHEDULE_POLICIES}")
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: (r.retractions == 0,))
    lengths = {r.rid: match_len(r) for r in waiting}
    return sorted(waiting, key=lambda r: (r.retractions == 0, -lengths[r.rid]))
