"""One forward's adapter layout: the token rows of each adapter slot, as segments."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvflow import kernels

__all__ = ["LoraBatch"]


@dataclass(frozen=True)
class LoraBatch:
    """Consecutive requests on the same slot form one segment: rows ``seg_indptr[g] :
    seg_indptr[g + 1]`` of the step's tokens use slot ``seg_slots[g]`` (-1: the base model,
    no delta). ``max_seg_len`` is the longest segment's rows, known on the host."""

    seg_indptr: torch.Tensor  # [G + 1] int32, on the model's device
    seg_slots: torch.Tensor  # [G] int32
    max_seg_len: int

    @classmethod
    def of(cls, slots: Sequence[int], rows: Sequence[int], device: str) -> LoraBatch | None:
        """Request ``i`` runs ``rows[i]`` token rows on slot ``slots[i]``; None when no
        request has an adapter."""
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
        packed = torch.tensor(bounds + seg_slots, dtype=torch.int32).to(device)
        return cls(packed[: len(bounds)], packed[len(bounds) :], max_len)

    def add_delta(
        self, x: torch.Tensor, out: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor
    ) -> torch.Tensor:
        """``out[rows of g] += (x @ A[slot].T) @ B[slot].T`` for each adapter segment, in
        place: Triton's segmented kernels on CUDA, one torch matmul per segment elsewhere."""
        x = x.reshape(-1, x.shape[-1]).contiguous()
        flat = out.view(-1, out.shape[-1])
        if x.is_cuda:
            h = kernels.lora_shrink(x, a_slots, self.seg_indptr, self.seg_slots, self.max_seg_len)
            kernels.lora_expand(h, b_slots, flat, self.seg_indptr, self.seg_slots, self.max_seg_len)
        else:
            h = kernels.lora_shrink_ref(x, a_slots, self.seg_indptr, self.seg_slots)
            kernels.lora_expand_ref(h, b_slots, flat, self.seg_indptr, self.seg_slots)
        return out
