"""One forward's adapter layout: the token rows of each adapter slot, as segments."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvflow import kernels
from kvflow.runtime.host_copy import host_to_device
from kvflow.runtime.layers.matmul import matmul_weight
from kvflow.runtime.lora.weights import SlotWeights

__all__ = ["DENSE_SHRINK_ROWS", "LOOP_SEGMENTS", "MASKED_ROWS", "LoraBatch", "row_mask"]

# NOTE: up to this many token rows (every decode step) the shrink is one GEMM of each row
# by every slot's A: at batch 32 on an H200 the segmented shrink and the sum of its split-K
# partials took 11 us a projection, bound by latency, while every slot's A is a few MB
DENSE_SHRINK_ROWS = 256
# NOTE: an eager step is bound by the host's launches (on an H200 host a 2 x 256-token
# prefill of the 8B shapes ran 5.3 ms of kernels in 19 ms), so an eager batch's LoRA is
# counted in library calls: with up to LOOP_SEGMENTS adapter segments (one prompt) two
# cuBLAS matmuls a segment; with more, up to MASKED_ROWS rows, two matmuls over every
# slot (the shrink's columns of other slots zeroed by the batch's row mask). Triton's
# eager launches cost the host far more (its segmented path ~120 us a projection)
LOOP_SEGMENTS = 1
# NOTE: the masked matmuls read every slot at full width: past this many rows their FLOPs
# grow past the segmented kernels' (a long prompt is one segment: the loop)
MASKED_ROWS = 2048


def row_mask(
    segments: Sequence[tuple[int, int, int]],
    rows: int,
    num_slots: int,
    dtype: torch.dtype,
    device: str,
) -> torch.Tensor:
    """``[rows, num_slots, 1]`` in ``dtype``: 1 where the row's segment runs on the slot,
    0 elsewhere (rows of the base model: all 0); built on the host, its copy queued behind
    the work in flight (pinned memory on CUDA)."""
    on_cuda = str(device).startswith("cuda")
    host = torch.zeros(rows, num_slots, 1, dtype=dtype, pin_memory=on_cuda)
    for start, end, slot in segments:
        host[start:end, slot] = 1
    return host.to(device, non_blocking=True) if on_cuda else host


@dataclass(frozen=True)
class LoraBatch:
    """Positions ``seg_indptr[g] : seg_indptr[g + 1]`` use slot ``seg_slots[g]`` (-1: the
    base model, no delta); position ``p`` is token row ``row_order[p]``, or row ``p`` when
    ``row_order`` is None (eager batches: consecutive requests on one slot form a segment).
    ``max_seg_len`` is the longest segment's positions, known on the host. ``slot_ranks``:
    each slot's adapter rank (the manager's, rewritten when an adapter enters a slot; None:
    every slot at the layers' ``max_rank``). The layout of :mod:`kvflow.kernels.lora`.
    ``segments``: the segments with a slot as ``(first row, end, slot)``, when known on the
    host (eager batches; None in decode graphs). ``row_mask``: :func:`row_mask`, where the
    batch takes the masked matmuls (:meth:`add_delta`)."""

    seg_indptr: torch.Tensor  # [G + 1] int32, on the model's device
    seg_slots: torch.Tensor  # [G] int32
    max_seg_len: int
    row_order: torch.Tensor | None = None  # [positions] int32, distinct rows
    slot_ranks: torch.Tensor | None = None  # [slots] int32
    segments: tuple[tuple[int, int, int], ...] | None = None
    row_mask: torch.Tensor | None = None  # [rows, slots, 1] in the model's dtype

    @classmethod
    def of(
        cls,
        slots: Sequence[int],
        rows: Sequence[int],
        device: str,
        slot_ranks: torch.Tensor | None = None,
        *,
        num_slots: int = 0,
        dtype: torch.dtype | None = None,
    ) -> LoraBatch | None:
        """Request ``i`` runs ``rows[i]`` token rows on slot ``slots[i]``; None when no
        request has an adapter. ``num_slots`` and ``dtype`` (the layers'): on CUDA, a batch
        of more than :data:`LOOP_SEGMENTS` adapter segments and up to :data:`MASKED_ROWS`
        rows gets its :func:`row_mask`."""
        if all(slot < 0 for slot in slots):
            return None
        bounds: list[int] = [0]
        seg_slots: list[int] = []
        for slot, count in zip(slots, rows, strict=True):
            if seg_slots and seg_slots[-1] == slot:
                bounds[-1] += count
            else:
                seg_slots.append(slot)
                bounds.append(bounds[-1] + count)
        max_len = max(b - a for a, b in itertools.pairwise(bounds))
        # NOTE: queued behind the work in flight: a pageable copy made the host wait for the
        # GPU before launching every eager forward with adapters (prefills)
        packed = host_to_device(bounds + seg_slots, str(device), torch.int32)
        segments = tuple(
            (start, end, slot)
            for start, end, slot in zip(bounds, bounds[1:], seg_slots, strict=False)
            if slot >= 0 and end > start
        )
        mask = None
        if (
            str(device).startswith("cuda") and num_slots and dtype is not None
            and len(segments) > LOOP_SEGMENTS and bounds[-1] <= MASKED_ROWS
        ):  # fmt: skip
            mask = row_mask(segments, bounds[-1], num_slots, dtype, str(device))
        return cls(
            packed[: len(bounds)], packed[len(bounds) :], max_len, slot_ranks=slot_ranks,
            segments=segments, row_mask=mask,
        )  # fmt: skip

    def joins(self, x: torch.Tensor) -> bool:
        """Whether :meth:`base_and_delta` runs ``x`` (for weights with a ``joint``
        buffer): a batch whose segments live on the device (the decode graphs'), up to
        :data:`DENSE_SHRINK_ROWS` rows; an eager batch of up to :data:`MASKED_ROWS` rows
        with a ``row_mask`` or one adapter segment over every row (a prompt)."""
        rows = x.numel() // x.shape[-1]
        if self.segments is None:
            return rows <= DENSE_SHRINK_ROWS
        whole = len(self.segments) == 1 and self.segments[0][:2] == (0, rows)
        return rows <= MASKED_ROWS and (self.row_mask is not None or whole)

    def base_and_delta(self, x: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
        """The projection's output with the deltas, where :meth:`joins`, for weights whose
        ``joint`` buffer holds the base weight and every slot's A: one GEMM gives the
        base output and every slot's shrink (``[rows, N + slots * R]``), then

        - the decode graphs: the expand writes ``base + delta`` into a new output, reading
          each row's slot's block of the shrink (:func:`~kvflow.kernels.lora_expand`'s
          ``base``; the segments cover every row: the base model's and the padding last);
        - one segment over every row: ``addmm(base, h of its slot, B.T)``;
        - a ``row_mask``: the other slots' columns of each row zeroed in place, then
          ``addmm(base, h, every slot's B.T)``.

        On the host an eager batch's projection is two library calls (three with a mask),
        one fewer than the separate matmuls (:meth:`add_delta`); the GEMM's extra columns
        cost ``slots * R / N`` of its work (under 13% for the 8B shapes' QKV at four
        slots of rank 64, 2% for gate-up)."""
        assert weights.joint is not None, "weights without a joint buffer"
        n = weights.b.shape[1]
        rows = x.reshape(-1, x.shape[-1])
        joint = matmul_weight(rows if rows.is_contiguous() else rows.contiguous(), weights.joint)
        base, h = joint[:, :n], joint[:, n:]
        if self.segments is None:
            out = joint.new_empty(joint.shape[0], n)
            kernels.lora_expand(
                h, weights.b, out, self.seg_indptr, self.seg_slots, self.max_seg_len,
                row_order=self.row_order, slot_ranks=self.slot_ranks,
                shard_rows=weights.shard_rows, h_by_slot=True, base=base,
            )  # fmt: skip
        elif self.row_mask is not None:
            h.view(h.shape[0], self.row_mask.shape[1], -1).mul_(self.row_mask)
            out = torch.addmm(base, h, weights.b_cat)
        else:
            ((_, _, slot),) = self.segments
            width = weights.a.shape[1]
            out = torch.addmm(base, h[:, slot * width : (slot + 1) * width], weights.b_t[slot])
        return out.view(*x.shape[:-1], n)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, weights: SlotWeights) -> torch.Tensor:
        """``out[rows of g] += (x @ A[slot].T) @ B[slot].T`` for each adapter segment, in
        place, each shard (``weights.shard_rows``: its output rows) through its own block
        of the slots at the adapter's rank. Segments known on the host (an eager batch), up
        to :data:`LOOP_SEGMENTS` of them on CUDA and any number elsewhere: two torch
        matmuls a segment (:func:`~kvflow.kernels.lora_delta_segments`); with a
        ``row_mask``, two over every slot (:func:`~kvflow.kernels.lora_delta_masked`).
        Otherwise Triton's segmented kernels on CUDA (the shrink one GEMM over every slot
        for up to :data:`DENSE_SHRINK_ROWS` rows: the decode graphs), torch matmuls per
        segment and shard elsewhere."""
        # NOTE: an eager step is bound by the host, and each torch call costs it
        # microseconds: none that would change nothing
        if x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        flat = out if out.dim() == 2 else out.view(-1, out.shape[-1])
        if self.segments is not None and (not x.is_cuda or len(self.segments) <= LOOP_SEGMENTS):
            kernels.lora_delta_segments(x, flat, weights.a_t, weights.b_t, self.segments)
            return out
        if self.row_mask is not None:
            kernels.lora_delta_masked(x, flat, weights.a_cat, weights.b_cat, self.row_mask)
            return out
        a_slots, b_slots, shard_rows = weights.a, weights.b, weights.shard_rows
        indptr, slots, order, ranks = (
            self.seg_indptr,
            self.seg_slots,
            self.row_order,
            self.slot_ranks,
        )
        shards = len(shard_rows)
        if x.is_cuda and x.shape[0] <= DENSE_SHRINK_ROWS:
            kernels.lora_expand(
                kernels.lora_shrink_dense(x, a_slots), b_slots, flat, indptr, slots,
                self.max_seg_len, row_order=order, slot_ranks=ranks, shard_rows=shard_rows,
                h_by_slot=True,
            )  # fmt: skip
        elif x.is_cuda:
            h = kernels.lora_shrink(
                x, a_slots, indptr, slots, self.max_seg_len,
                row_order=order, slot_ranks=ranks, num_shards=shards,
            )  # fmt: skip
            kernels.lora_expand(
                h, b_slots, flat, indptr, slots, self.max_seg_len,
                row_order=order, slot_ranks=ranks, shard_rows=shard_rows,
            )  # fmt: skip
        else:
            h = kernels.lora_shrink_ref(
                x, a_slots, indptr, slots, row_order=order, slot_ranks=ranks, num_shards=shards
            )
            kernels.lora_expand_ref(
                h, b_slots, flat, indptr, slots,
                row_order=order, slot_ranks=ranks, shard_rows=shard_rows,
            )  # fmt: skip
        return out
