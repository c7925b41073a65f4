"""What the scheduler must see the same on every tensor-parallel rank.

Each rank runs its own scheduler over its own KV pool, and they stay equal only if every
decision is: the same messages in the same order (the scheduler process broadcasts them),
the same sampled ids (the sampler broadcasts them), and the same answer to the two
questions a scheduler otherwise answers alone: what time it is (lpm's aging of waiting
requests) and whether an asynchronous job (a grammar compile, a HiCache storage transfer)
has ended, and with what result. Parts that only rank 0 sees (the prefill's bootstrap
rooms, the decode's watcher of its prefills) are decided there and :meth:`Lockstep.share`d.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.runtime.distributed.group import TPGroup

__all__ = ["Lockstep", "TPLockstep"]


class Lockstep:
    """One rank alone: the local clock, and what it sees is what happened."""

    rank = 0
    size = 1

    def now(self) -> float:
        """Monotonic seconds, the same on every rank."""
        return time.monotonic()

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Per position, whether the flag holds on every rank (collective under TP)."""
        return flags

    def all_min(self, values: list[int]) -> list[int]:
        """Per position, the smallest value any rank has (collective under TP)."""
        return values

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` (picklable) on every rank; the others' are ignored (collective
        under TP)."""
        return value

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order (collective under TP)."""
        return [value]


class TPLockstep(Lockstep):
    """Ranks of one group: rank 0's clock, sent with each round of messages
    (:meth:`tick`), and flags agreed over the group (an event counts once every rank has
    seen it)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.rank, self.size = tp.rank, tp.size
        self._now = time.monotonic()

    def tick(self, now: float) -> None:
        self._now = now

    def now(self) -> float:
        return self._now

    def all_true(self, flags: list[bool]) -> list[bool]:
        return self.tp.all_true(flags)

    def all_min(self, values: list[int]) -> list[int]:
        return self.tp.all_min(values)

    def share(self, value: Any) -> Any:
        return self.tp.broadcast_object(value if self.tp.is_first else None)

    def gather(self, value: Any) -> list[Any]:
        return self.tp.all_gather_object(value)
