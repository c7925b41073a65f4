"""Which bytes go where: KV slots of one pool into KV slots of a peer's pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvflow.runtime.disagg.layout import KVLayout

__all__ = ["Write", "transfer_plan"]


class Write(NamedTuple):
    """Copy ``nbytes`` from local address ``src_ptr`` to the peer's address ``dst_ptr``."""

    src_ptr: int
    dst_ptr: int
    nbytes: int


class _Run(NamedTuple):
    src_slot: int
    dst_slot: int
    num_slots: int


def transfer_plan(
    src: KVLayout, dst: KVLayout, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> list[Write]:
    """The writes that put ``src`` slot ``src_slots[i]`` at ``dst`` slot ``dst_slots[i]``,
    in every layer's K and V buffer.

    Runs where both the source and the destination slots are consecutive become one write
    per buffer, so a contiguous transfer of any length is ``2 * num_layers`` writes.
    Raises ``ValueError`` when the layouts differ in shape, the two slot lists differ in
    length, or a slot lies outside its pool.
    """
    problem = src.mismatch(dst)
    if problem is not None:
        raise ValueError(problem)
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destination slots")
    runs = _runs([int(s) for s in src_slots], [int(s) for s in dst_slots], src, dst)
    size = src.slot_bytes
    writes: list[Write] = []
    for layer in range(src.num_layers):
        for src_base, dst_base in (
            (src.k_addrs[layer], dst.k_addrs[layer]),
            (src.v_addrs[layer], dst.v_addrs[layer]),
        ):
            writes.extend(
                Write(
                    src_base + run.src_slot * size,
                    dst_base + run.dst_slot * size,
                    run.num_slots * size,
                )
                for run in runs
            )
    return writes


def _runs(src_slots: list[int], dst_slots: list[int], src: KVLayout, dst: KVLayout) -> list[_Run]:
    for side, slots, layout in (("source", src_slots, src), ("destination", dst_slots, dst)):
        bad = [s for s in slots if not 0 <= s < layout.num_slots]
        if bad:
            raise ValueError(f"{side} slots {bad[:5]} out of range [0, {layout.num_slots})")
    runs: list[_Run] = []
    start = 0
    for i in range(1, len(src_slots) + 1):
        if (
            i == len(src_slots)
            or src_slots[i] != src_slots[i - 1] + 1
            or dst_slots[i] != dst_slots[i - 1] + 1
        ):
            runs.append(_Run(src_slots[start], dst_slots[start], i - start))
            start = i
    return runs
