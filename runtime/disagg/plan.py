"""Which bytes go where: KV slots of one pool into KV slots of a peer's pool.

:func:`slot_plan` is the plan as runs of slots (a few numpy arrays however many layers the
model has); :meth:`SlotPlan.writes` expands it into the byte ranges a transfer engine
takes, one per run per K or V buffer (:func:`transfer_plan`), and per run of an EAGLE
target's features where both layouts have them (:meth:`SlotPlan.feature_writes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvflow.runtime.disagg.layout import KVLayout

if TYPE_CHECKING:  # numpy loads with the first plan: the server's HTTP process needs none
    import numpy as np

__all__ = ["SlotPlan", "Write", "slot_plan", "transfer_plan"]


class Write(NamedTuple):
    """Copy ``nbytes`` from local address ``src_ptr`` to the peer's address ``dst_ptr``."""

    src_ptr: int
    dst_ptr: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class SlotPlan:
    """Run ``i`` copies ``counts[i]`` slots from ``src`` slot ``src_starts[i]`` to ``dst``
    slot ``dst_starts[i]``, in every layer's K and V buffer and in the features' buffer
    when the layouts have one (int64 arrays, checked against both pools by
    :func:`slot_plan`, which also makes sure both or neither have features)."""

    src: KVLayout
    dst: KVLayout
    src_starts: np.ndarray
    dst_starts: np.ndarray
    counts: np.ndarray

    @property
    def num_slots(self) -> int:
        return int(self.counts.sum())

    @property
    def nbytes(self) -> int:
        """Bytes moved over all layers, K and V, and the features."""
        per_slot = self.src.slot_bytes * 2 * self.src.num_layers + self.src.feature_bytes
        return self.num_slots * per_slot

    def buffers(self) -> list[tuple[int, int]]:
        """(source, destination) address of every K and V buffer, layer by layer."""
        src, dst = self.src, self.dst
        return [
            pair
            for layer in range(src.num_layers)
            for pair in (
                (src.k_addrs[layer], dst.k_addrs[layer]),
                (src.v_addrs[layer], dst.v_addrs[layer]),
            )
        ]

    def writes(self) -> list[Write]:
        """One write per run per buffer, buffer by buffer (K and V, then the features)."""
        kv = self._runs(self.buffers(), self.src.slot_bytes)
        return kv + self.feature_writes()

    def feature_writes(self) -> list[Write]:
        """One write per run of the features' buffer (none without features)."""
        if not self.src.features:
            return []
        pair = [(self.src.feature_addr, self.dst.feature_addr)]
        return self._runs(pair, self.src.feature_bytes)

    def _runs(self, buffers: list[tuple[int, int]], size: int) -> list[Write]:
        runs = list(
            zip(
                (self.src_starts * size).tolist(),
                (self.dst_starts * size).tolist(),
                (self.counts * size).tolist(),
                strict=True,
            )
        )
        return [
            Write(src_base + s, dst_base + d, n)
            for src_base, dst_base in buffers
            for s, d, n in runs
        ]


def slot_plan(
    src: KVLayout, dst: KVLayout, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> SlotPlan:
    """The plan that puts ``src`` slot ``src_slots[i]`` at ``dst`` slot ``dst_slots[i]``.

    Runs where both the source and the destination slots are consecutive are one run, so a
    contiguous transfer of any length is one run. Raises ``ValueError`` when the layouts
    differ in shape, the two slot lists differ in length, or a slot lies outside its pool.
    """
    import numpy as np

    problem = src.mismatch(dst)
    if problem is not None:
        raise ValueError(problem)
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destination slots")
    source = np.asarray(src_slots, dtype=np.int64).reshape(-1)
    target = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    for side, slots, layout in (("source", source, src), ("destination", target, dst)):
        bad = slots[(slots < 0) | (slots >= layout.num_slots)]
        if bad.size:
            raise ValueError(
                f"{side} slots {bad[:5].tolist()} out of range [0, {layout.num_slots})"
            )
    # a run starts where either side does not continue the one before
    if not source.size:
        empty = np.zeros(0, dtype=np.int64)
        return SlotPlan(src, dst, empty, empty, empty)
    breaks = np.flatnonzero((np.diff(source) != 1) | (np.diff(target) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.append(breaks, source.size)
    return SlotPlan(src, dst, source[starts], target[starts], ends - starts)


def transfer_plan(
    src: KVLayout, dst: KVLayout, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> list[Write]:
    """The writes that put ``src`` slot ``src_slots[i]`` at ``dst`` slot ``dst_slots[i]``,
    in every layer's K and V buffer: :func:`slot_plan`'s runs as byte ranges (a contiguous
    transfer of any length is ``2 * num_layers`` writes). Raises as :func:`slot_plan`."""
    return slot_plan(src, dst, src_slots, dst_slots).writes()
