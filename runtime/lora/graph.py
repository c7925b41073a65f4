"""LoRA inside the decode CUDA graphs: every request of a decode batch is its own
one-row segment, so the segment bounds are fixed (``0, 1, ..., max_bs``) and only each
row's slot changes between replays.

Static buffers (allocated once, for the largest captured batch)::

    seg_indptr [max_bs + 1] int32   0, 1, ..., max_bs        (never rewritten)
    seg_slots  [max_bs]     int32   row i's adapter slot; -1: the base model or padding

A graph captured for ``bs`` rows runs the segmented kernels over ``seg_indptr[:bs + 1]``
and ``seg_slots[:bs]`` with one row per segment; :meth:`LoraGraphInputs.fill_replay`
assigns the batch's adapters to device slots (copying the weights of any not resident,
queued on the stream before the replay) and writes ``seg_slots``. A batch with no adapter
runs the same graph with every slot at -1 (the kernels skip those rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvflow.runtime.forward_batch import ForwardBatch
from kvflow.runtime.lora.batch import LoraBatch
from kvflow.runtime.lora.manager import LoraManager

__all__ = ["LoraGraphInputs"]


class LoraGraphInputs:
    """The adapter part of a decode graph's inputs (``cuda_graph.GraphInputs``)."""

    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager
        self.seg_indptr: torch.Tensor | None = None
        self.seg_slots: torch.Tensor | None = None

    def init_capture(self, max_bs: int) -> None:
        device = self.manager.device
        self.seg_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.seg_slots = torch.full((max_bs,), -1, dtype=torch.int32, device=device)

    def fill_replay(self, fb: ForwardBatch, padded_bs: int) -> None:
        assert self.seg_slots is not None, "init_capture first"
        slots = self.manager.assign_slots(fb) or [-1] * fb.batch_size
        rows = slots + [-1] * (padded_bs - len(slots))
        # NOTE: from pinned memory, queued behind the work in flight (a pageable copy
        # would make the host wait for it: staging runs while the previous step computes)
        on_cuda = self.seg_slots.is_cuda
        host = torch.tensor(rows, dtype=torch.int32, pin_memory=on_cuda)
        self.seg_slots[:padded_bs].copy_(host, non_blocking=on_cuda)

    @contextmanager
    def capturing(self, bs: int) -> Iterator[None]:
        """While a graph of ``bs`` rows is warmed up and captured, the model's LoRA layers
        read the static segments."""
        assert self.seg_indptr is not None and self.seg_slots is not None, "init_capture first"
        context = self.manager.context
        context.batch = LoraBatch(self.seg_indptr[: bs + 1], self.seg_slots[:bs], 1)
        try:
            yield
        finally:
            context.batch = None
