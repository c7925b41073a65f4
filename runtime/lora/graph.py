"""LoRA inside the decode CUDA graphs: a batch's rows grouped by adapter slot (Punica's and
SGLang's layout), so each adapter's weights are read once per step rather than once per
request. Every graph has one segment per device slot, then the base model's, in that fixed
order; the segment bounds and the row permutation are graph inputs.

Static buffers (allocated once, for the largest captured batch; ``S`` slots)::

    seg_slots  [S + 1]       int32   0, 1, ..., S - 1, -1            (never rewritten)
    packed     [S + 2 + max_bs] int32, one copy per replay:
      seg_indptr [S + 2]     segment g's positions; the last ends at the graph's rows
      row_order  [max_bs]    the rows of slot 0, of slot 1, ..., then the base model's
                             and the padding rows (each group in batch order)

A graph captured for ``bs`` rows runs the segmented kernels over all ``S + 1`` segments
with ``row_order[:bs]`` and ``max_seg_len = bs`` (one slot may take every row); a slot
without rows is an empty segment, whose programs exit at once. The manager's
``slot_ranks`` (a static tensor too) bounds each adapter's work at its own rank.
:meth:`LoraGraphInputs.fill_replay` assigns the batch's adapters to device slots (copying
the weights of any not resident, queued on the stream before the replay) and writes
``packed``. A batch with no adapter runs the same graph with every row in the base segment
(the kernels skip it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch

from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.lora.batch import LoraBatch
from kvflow.runtime.lora.manager import LoraManager

__all__ = ["LoraGraphInputs", "RowGroups", "group_rows"]


class RowGroups(NamedTuple):
    """A padded decode batch's rows grouped by slot: ``seg_indptr`` ``[num_slots + 2]``
    (slot 0's positions first, the base model's and the padding last) and ``row_order``
    (each position's row)."""

    seg_indptr: list[int]
    row_order: list[int]


def group_rows(slots: Sequence[int], padded_bs: int, num_slots: int) -> RowGroups:
    """Row ``i`` runs on ``slots[i]`` (-1: the base model); rows ``len(slots):padded_bs``
    are padding, in the base segment (no delta)."""
    groups: list[list[int]] = [[] for _ in range(num_slots + 1)]
    for row, slot in enumerate(slots):
        groups[slot if slot >= 0 else num_slots].append(row)
    groups[num_slots].extend(range(len(slots), padded_bs))
    bounds = [0, *itertools.accumulate(len(rows) for rows in groups)]
    return RowGroups(bounds, list(itertools.chain.from_iterable(groups)))


class LoraGraphInputs:
    """The adapter part of a decode graph's inputs (``cuda_graph.GraphInputs``)."""

    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager
        self.num_slots = manager.slots.num_slots
        self.packed: torch.Tensor | None = None
        self.seg_slots: torch.Tensor | None = None

    @property
    def seg_indptr(self) -> torch.Tensor:
        assert self.packed is not None, "init_capture first"
        return self.packed[: self.num_slots + 2]

    @property
    def row_order(self) -> torch.Tensor:
        assert self.packed is not None, "init_capture first"
        return self.packed[self.num_slots + 2 :]

    def init_capture(self, max_bs: int) -> None:
        device = self.manager.device
        self.packed = torch.zeros(self.num_slots + 2 + max_bs, dtype=torch.int32, device=device)
        self.seg_slots = torch.tensor(
            [*range(self.num_slots), -1], dtype=torch.int32, device=device
        )

    def fill_replay(self, fb: ForwardBatch, padded_bs: int) -> None:
        assert self.packed is not None, "init_capture first"
        slots = self.manager.assign_slots(fb) or [-1] * fb.batch_size
        groups = group_rows(slots, padded_bs, self.num_slots)
        # NOTE: from pinned memory, queued behind the work in flight (a pageable copy
        # would make the host wait for it: staging runs while the previous step computes)
        on_cuda = self.packed.is_cuda
        host = torch.tensor(
            groups.seg_indptr + groups.row_order, dtype=torch.int32, pin_memory=on_cuda
        )
        self.packed[: host.shape[0]].copy_(host, non_blocking=on_cuda)

    @contextmanager
    def capturing(self, bs: int) -> Iterator[None]:
        """While a graph of ``bs`` rows is warmed up and captured, the model's LoRA layers
        read the static segments."""
        assert self.seg_slots is not None, "init_capture first"
        context = self.manager.context
        context.batch = LoraBatch(
            self.seg_indptr,
            self.seg_slots,
            bs,
            row_order=self.row_order[:bs],
            slot_ranks=self.manager.slot_ranks,
        )
        try:
            yield
        finally:
            context.batch = None
