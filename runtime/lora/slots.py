"""Which adapter holds which device slot: a fixed number of slots, least recently used
evicted first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = ["LoraSlots", "SlotPlan"]


@dataclass(frozen=True)
class SlotPlan:
    """Adapter name -> slot for one batch (``slots``); ``loads``: the (name, slot) pairs
    whose weights must be copied in first."""

    slots: dict[str, int] = field(default_factory=dict)
    loads: list[tuple[str, int]] = field(default_factory=list)


class LoraSlots:
    """``num_slots`` device slots (``--max-loras-per-batch``). An adapter keeps its slot
    until another batch needs the slot and it is the least recently used adapter not in
    that batch; the scheduler admits no batch with more adapters than slots."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._held: OrderedDict[str, int] = OrderedDict()  # least recently used first

    def plan(self, names: Collection[str]) -> SlotPlan:
        """Slots for every adapter of a batch (marked used now); raises ValueError when
        the batch has more adapters than slots."""
        wanted = set(names)
        if len(wanted) > self.num_slots:
            raise ValueError(
                f"{len(wanted)} adapters in one batch; --max-loras-per-batch is {self.num_slots}"
            )
        plan = SlotPlan()
        free = sorted(set(range(self.num_slots)) - set(self._held.values()))
        for name in sorted(wanted):
            if name in self._held:
                self._held.move_to_end(name)
                plan.slots[name] = self._held[name]
                continue
            if free:
                slot = free.pop(0)
            else:
                victim = next(n for n in self._held if n not in wanted)
                slot = self._held.pop(victim)
            self._held[name] = slot
            plan.slots[name] = slot
            plan.loads.append((name, slot))
        return plan

    def drop(self, name: str) -> None:
        """Forget an unloaded adapter's slot (free for the next one)."""
        self._held.pop(name, None)

    @property
    def resident(self) -> list[str]:
        """Adapters in device slots, least recently used first."""
        return list(self._held)
