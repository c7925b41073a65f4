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
    adapter's rank or targets leave room); ``shard_rows``: each shard's output rows.

    B is stored transposed (``b`` is a view of ``[slots, R, output_size]`` memory), so
    every other form is a view made once, taking no operation a call (slots are written
    in place: the views stay valid): ``a_t`` and ``b_t``, each slot's ``A.T`` ``[K, R]``
    and ``B.T`` ``[R, N]`` (an eager batch's per-segment matmuls), and ``a_cat`` ``[slots
    * R, K]`` and ``b_cat`` ``[slots * R, N]``, every slot stacked (the masked matmuls).

    ``joint`` (None: A has memory of its own): ``[N + slots * R, K]``, the base
    projection's weight rows, then ``a_cat``'s, one buffer (:meth:`joined`), so one GEMM
    gives a row's base output and its shrink by every slot
    (:meth:`~kvflow.runtime.lora.LoraBatch.base_and_delta`)."""

    a: torch.Tensor
    b: torch.Tensor
    shard_rows: tuple[int, ...]
    a_t: tuple[torch.Tensor, ...]
    b_t: tuple[torch.Tensor, ...]
    a_cat: torch.Tensor
    b_cat: torch.Tensor
    joint: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        a: torch.Tensor,
        b_t: torch.Tensor,
        shard_rows: tuple[int, ...],
        joint: torch.Tensor | None = None,
    ) -> SlotWeights:
        """From ``a`` ``[slots, R, K]`` and ``b_t`` ``[slots, R, N]``, both contiguous
        (``a`` a view of ``joint``'s last rows, when given)."""
        if a.dim() != 3 or b_t.dim() != 3 or a.shape[:2] != b_t.shape[:2]:
            raise ValueError(f"A [slots, R, K] and B.T [slots, R, N], got {a.shape}, {b_t.shape}")
        if not (a.is_contiguous() and b_t.is_contiguous()):
            raise ValueError("A and B.T must be contiguous")
        if sum(shard_rows) != b_t.shape[2]:
            raise ValueError(f"shards of {shard_rows} rows do not fit B.T {tuple(b_t.shape)}")
        slots, width = a.shape[0], a.shape[1]
        return cls(
            a, b_t.transpose(1, 2), shard_rows, tuple(a[s].t() for s in range(slots)),
            tuple(b_t[s] for s in range(slots)), a.view(slots * width, -1),
            b_t.view(slots * width, -1), joint,
        )  # fmt: skip

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
        b_t = torch.zeros(num_slots, width, sum(shard_rows), dtype=dtype, device=device)
        return cls.of(a, b_t, shard_rows)

    @classmethod
    def joined(
        cls, weight: torch.Tensor, num_slots: int, max_rank: int, shard_rows: tuple[int, ...]
    ) -> SlotWeights:
        """Zeroed slots whose A shares one buffer with the base projection's ``weight``
        ``[N, K]``, copied into its first rows (``joint[:N]``: the caller's weight from now
        on, a contiguous view)."""
        n, k = weight.shape
        width = len(shard_rows) * max_rank
        joint = torch.empty(n + num_slots * width, k, dtype=weight.dtype, device=weight.device)
        joint[:n].copy_(weight)
        joint[n:].zero_()
        b_t = torch.zeros(num_slots, width, n, dtype=weight.dtype, device=weight.device)
        return cls.of(joint[n:].view(num_slots, width, k), b_t, shard_rows, joint)
