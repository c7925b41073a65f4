"""The segmented LoRA matmuls in pure torch: the contract of :mod:`kvflow.kernels.lora`'s
Triton kernels (see its docstring for the layout), one matmul per segment and shard; and
the torch paths serving uses (the dense shrink of a decode step, the per-segment loop of an
eager batch whose segments are known on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "lora_delta_masked",
    "lora_delta_segments",
    "lora_expand_ref",
    "lora_shrink_dense",
    "lora_shrink_ref",
]


def _segments(seg_indptr: torch.Tensor, seg_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first position, end, slot) of every segment that has a slot and rows."""
    bounds = seg_indptr.tolist()
    segments = zip(bounds, bounds[1:], seg_slots.tolist(), strict=False)
    return [(start, end, slot) for start, end, slot in segments if slot >= 0 and end > start]


def _rows(row_order: torch.Tensor | None, start: int, end: int) -> slice | torch.Tensor:
    """The token rows at positions ``start:end``: a slice without a permutation."""
    return slice(start, end) if row_order is None else row_order[start:end].long()


def _rank(slot_ranks: list[int] | None, slot: int, width: int) -> int:
    return width if slot_ranks is None else min(slot_ranks[slot], width)


def lora_shrink_ref(
    x: torch.Tensor,
    a_weights: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    row_order: torch.Tensor | None = None,
    slot_ranks: torch.Tensor | None = None,
    num_shards: int = 1,
) -> torch.Tensor:
    """Pure-torch :func:`~kvflow.kernels.lora.lora_shrink`: ``h`` ``[T, R]`` by position,
    zeros outside the adapters' ranks and on segments without a slot."""
    h = x.new_zeros((x.shape[0], a_weights.shape[1]))
    width = a_weights.shape[1] // num_shards
    ranks = None if slot_ranks is None else slot_ranks.tolist()
    for start, end, slot in _segments(seg_indptr, seg_slots):
        rank = _rank(ranks, slot, width)
        if rank == 0:  # a slot no adapter was written to
            continue
        a = a_weights[slot].reshape(num_shards, width, -1)[:, :rank].flatten(0, 1)
        product = x[_rows(row_order, start, end)] @ a.t()
        h[start:end].view(end - start, num_shards, width)[:, :, :rank] = product.view(
            end - start, num_shards, rank
        )
    return h


def lora_shrink_dense(x: torch.Tensor, a_weights: torch.Tensor) -> torch.Tensor:
    """Every row of ``x`` ``[T, K]`` times every slot's ``A`` (``a_weights`` ``[slots, R,
    K]``, contiguous): ``[T, slots * R]``, slot ``s``'s block at columns ``s * R``; one GEMM
    (cuBLAS on CUDA), for :func:`~kvflow.kernels.lora.lora_expand`'s ``h_by_slot``."""
    return torch.nn.functional.linear(x, a_weights.view(-1, a_weights.shape[-1]))


def lora_delta_segments(
    x: torch.Tensor,
    out: torch.Tensor,
    a_t: Sequence[torch.Tensor],
    b_t: Sequence[torch.Tensor],
    segments: Sequence[tuple[int, int, int]],
) -> torch.Tensor:
    """``out[start:end] += (x[start:end] @ a_t[slot]) @ b_t[slot]`` in place for each
    ``(start, end, slot)`` of ``segments`` (consecutive token rows, slot >= 0, known on the
    host), with ``a_t[slot]`` the slot's ``A.T`` ``[K, R]`` and ``b_t[slot]`` its ``B.T``
    ``[R, N]``: two library matmuls a segment and nothing else (no launch per shard, no
    device read of the layout; a segment of every row slices nothing). Each matmul spans
    the slot's whole width, every shard's block and all of B: exact because the slots hold
    zeros past each adapter's rank and off B's shard diagonal
    (:class:`~kvflow.runtime.lora.LoraLinear`'s layout), which it reads, unlike the Triton
    kernels. ``h`` is rounded to ``x``'s dtype and the sum with ``out`` to ``out``'s, as
    :func:`~kvflow.kernels.lora.lora_expand` rounds."""
    rows = x.shape[0]
    for start, end, slot in segments:
        if start == 0 and end == rows:
            out.addmm_(torch.mm(x, a_t[slot]), b_t[slot])
        else:
            out[start:end].addmm_(torch.mm(x[start:end], a_t[slot]), b_t[slot])
    return out


def lora_delta_masked(
    x: torch.Tensor,
    out: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    row_mask: torch.Tensor,
) -> torch.Tensor:
    """``out += ((x @ a_cat.T) * row_mask) @ b_cat`` in place: every row of ``x`` ``[T,
    K]`` by every slot's A (``a_cat`` ``[slots * R, K]``), each row's columns of other
    slots zeroed (``row_mask`` ``[T, slots, 1]``: 1 on the row's slot, none on the base
    model's rows), then by every slot's ``B.T`` (``b_cat`` ``[slots * R, N]``): two library
    matmuls and one multiply, however many segments the rows form. Reads every slot at
    its whole width, as :func:`lora_delta_segments` does (exact on the same zeros), and
    rounds as it does."""
    h = torch.nn.functional.linear(x, a_cat)
    h.view(row_mask.shape[0], row_mask.shape[1], -1).mul_(row_mask)
    return out.addmm_(h, b_cat)


def lora_expand_ref(
    h: torch.Tensor,
    b_weights: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    row_order: torch.Tensor | None = None,
    slot_ranks: torch.Tensor | None = None,
    shard_rows: tuple[int, ...] | None = None,
    h_by_slot: bool = False,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch :func:`~kvflow.kernels.lora.lora_expand` (in place on ``out``; with
    ``base``, every segment's rows of ``out`` are first set to ``base``'s): B's blocks off
    the shards' diagonal are never read."""
    if base is not None:
        rows = _rows(row_order, int(seg_indptr[0]), int(seg_indptr[-1]))
        out[rows] = base[rows]
    shard_rows = shard_rows or (b_weights.shape[1],)
    stacked = b_weights.shape[2]
    width = stacked // len(shard_rows)
    ranks = None if slot_ranks is None else slot_ranks.tolist()
    for start, end, slot in _segments(seg_indptr, seg_slots):
        rank = _rank(ranks, slot, width)
        rows, first_row = _rows(row_order, start, end), 0
        h_rows = h[rows, slot * stacked :] if h_by_slot else h[start:end]
        for shard, num_rows in enumerate(shard_rows):
            cols = slice(shard * width, shard * width + rank)
            out_cols = slice(first_row, first_row + num_rows)
            delta = h_rows[:, cols] @ b_weights[slot, out_cols, cols].t()
            out[rows, out_cols] += delta.to(out.dtype)
            first_row += num_rows
    return out
