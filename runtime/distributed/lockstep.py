"""What the scheduler must see the same on every tensor-parallel rank.

Each rank runs its own scheduler over its own KV pool, and they stay equal only if every
decision is: the same messages in the same order (the scheduler process broadcasts them),
the same sampled ids (the sampler broadcasts them), and the same answer to the two
questions a scheduler otherwise answers alone: what time it is (lpm's aging of waiting
requests) and whether an asynchronous job (a grammar compile, a HiCache storage transfer)
has ended, and with what result.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.runtime.distributed.group import TPGroup

__all__ = ["Lockstep", "TPLockstep"]


class Lockstep:
    """One rank alone: the local clock, and what it sees is what happened."""

    def now(self) -> float:
        """Monotonic seconds, the same on every rank."""
        return time.monotonic()

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Per position, whether the flag holds on every rank (collective under TP)."""
        return flags

    def all_min(self, values: list[int]) -> list[int]:
        """Per position, the smallest value any rank has (collective under TP)."""
        return values


class TPLockstep(Lockstep):
    """Ranks of one group: rank 0's clock, sent with each round of messages
    (:meth:`tick`), and flags agreed over the group (an event counts once every rank has
    seen it)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self._now = time.monotonic()

    def tick(self, now: float) -> None:
        self._now = now

    def now(self) -> float:
        return self._now

    def all_true(self, flags: list[bool]) -> list[bool]:
        return self.tp.all_true(flags)

    def all_min(self, values: list[int]) -> list[int]:
        return self.tp.all_min(values)
