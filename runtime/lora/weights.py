"""One wrapped projection's adapter slots on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SlotWeights"]


@dataclass(frozen=True)
class SlotWeights:
    """``a`` ``[slots, shards * max_rank, input_size]`` and ``b`` ``[slots, output_size,
    shards * max_rank]`` (:class:`~kvflow.runtime.lora.LoraLinear`'s layout: each shard's
    block of ``max_rank`` rows of A and columns of B, B block-diagonal, zeros where an
    adapter's rank or targets leave room); ``shard_rows``: each shard's output rows. ``a_t``
    and ``b_t``: each slot's ``A.T`` ``[input_size, R]`` and ``B.T`` ``[R, output_size]``,
    views of ``a`` and ``b`` made once, so an eager batch's per-segment matmuls take no
    view operation a call (slots are written in place: the views stay valid)."""

    a: torch.Tensor
    b: torch.Tensor
    shard_rows: tuple[int, ...]
    a_t: tuple[torch.Tensor, ...]
    b_t: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor, shard_rows: tuple[int, ...]) -> SlotWeights:
        if a.dim() != 3 or b.dim() != 3 or a.shape[:2] != (b.shape[0], b.shape[2]):
            raise ValueError(f"A [slots, R, K] and B [slots, N, R], got {a.shape}, {b.shape}")
        if sum(shard_rows) != b.shape[1]:
            raise ValueError(f"shards of {shard_rows} rows do not fit B {tuple(b.shape)}")
        slots = range(a.shape[0])
        return cls(a, b, shard_rows, tuple(a[s].t() for s in slots), tuple(b[s].t() for s in slots))

    @classmethod
    def zeros(
        cls,
        num_slots: int,
        max_rank: int,
        input_size: int,
        shard_rows: tuple[int, ...],
        dtype: torch.dtype,
        device: str,
    ) -> SlotWeights:
        width = len(shard_rows) * max_rank
        a = torch.zeros(num_slots, width, input_size, dtype=dtype, device=device)
        b = torch.zeros(num_slots, sum(shard_rows), width, dtype=dtype, device=device)
        return cls.of(a, b, shard_rows)
