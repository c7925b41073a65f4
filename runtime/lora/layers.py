"""A linear layer with the batch's LoRA deltas added to its output."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.runtime.layers import LinearBase, UnquantizedLinearMethod, silu_and_mul
from kvflow.runtime.lora.batch import LoraBatch
from kvflow.runtime.lora.weights import SlotWeights

__all__ = ["LoraContext", "LoraLinear"]


class LoraContext:
    """The adapter layout of the forward being run (``batch``, None: no adapter in it),
    shared by every :class:`LoraLinear` of a model; set for one forward by
    :meth:`~kvflow.runtime.lora.LoraManager.active`."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraLinear(nn.Module):
    """Wraps a projection (``base``, any :class:`LinearBase`, any weight method): ``y =
    base(x) + scaling * (x @ A.T) @ B.T`` per request's adapter. Under tensor parallelism
    the slots hold this rank's part of each adapter (B's rows of a column-parallel
    projection, A's columns of a row-parallel one).

    Each of the layer's shards (q, k, v of a merged QKV; gate, up) gets ``max_rank`` rows
    of the stacked ``A`` and columns of ``B``: ``a_slots`` ``[slots, shards * max_rank,
    input_size]``, ``b_slots`` ``[slots, output_size, shards * max_rank]``, B block-diagonal
    over the shards, zero where an adapter's rank or targets leave room (the kernels read
    each shard's block only up to the slot's rank, and B only on its diagonal), in
    ``weights`` (:class:`~kvflow.runtime.lora.weights.SlotWeights`).

    ``join_base``: where the base projection is a plain weight without a bias in
    ``dtype`` (the unquantized method), its weight and the slots' A share one buffer
    (:meth:`SlotWeights.joined`; ``base.weight`` becomes a view of its first rows), and a
    batch that :meth:`~kvflow.runtime.lora.LoraBatch.joins` (the decode graphs', an eager
    prompt over the whole batch, a masked eager batch) runs one GEMM for the base output
    and every slot's shrink, then adds the deltas onto its base columns
    (:meth:`~kvflow.runtime.lora.LoraBatch.base_and_delta`): in the decode graphs two
    kernels a projection where the separate GEMMs took four (on an H200, the dense shrink
    is a split-K GEMM and the sum of its partials)."""

    def __init__(
        self,
        base: LinearBase,
        context: LoraContext,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: str,
        *,
        join_base: bool = False,
    ) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.max_rank = max_rank
        self.output_sizes: tuple[int, ...] = tuple(base.output_sizes)
        if join_base and _plain_weight(base, dtype):
            self.weights = SlotWeights.joined(base.weight, num_slots, max_rank, self.output_sizes)
            assert self.weights.joint is not None
            base.weight.data = self.weights.joint[: base.output_size]
        else:
            self.weights = SlotWeights.zeros(
                num_slots, max_rank, base.input_size, self.output_sizes, dtype, device
            )

    @property
    def a_slots(self) -> torch.Tensor:
        return self.weights.a

    @property
    def b_slots(self) -> torch.Tensor:
        return self.weights.b

    def clear_slot(self, slot: int) -> None:
        self.a_slots[slot].zero_()
        self.b_slots[slot].zero_()

    def write_slot(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Shard ``shard``'s ``a`` ``[r, input_size]`` and ``b`` ``[shard rows, r]`` (scaled),
        the whole projection's: under tensor parallelism this rank keeps its part
        (:meth:`~kvflow.runtime.layers.LinearBase.lora_part`)."""
        a, b = self.base.lora_part(a, b, shard)
        rank, first = a.shape[0], shard * self.max_rank
        row = sum(self.output_sizes[:shard])
        self.a_slots[slot, first : first + rank].copy_(a)
        self.b_slots[slot, row : row + b.shape[0], first : first + rank].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is None:
            return self.base(x)
        # NOTE: a row-parallel projection's delta joins its partial product before the
        # all-reduce (this rank's input columns times its columns of A), summed with it
        if self.weights.joint is not None and batch.joins(x):
            out = batch.base_and_delta(x, self.weights)
        else:
            out = self.base.method.apply(self.base, x)
            out = batch.add_delta(x, out, self.weights)
        return self.base.reduce(out)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A merged ``[gate; up]``'s ``silu(gate) * up`` (the delta is added before it)."""
        if self.context.batch is None:
            return self.base.silu_mul(x)  # type: ignore[operator]
        return silu_and_mul(self.forward(x))


def _plain_weight(base: LinearBase, dtype: torch.dtype) -> bool:
    """The projection is ``x @ weight.T``: the unquantized method's weight in ``dtype``,
    no bias."""
    return (
        type(base.method) is UnquantizedLinearMethod
        and base.bias is None
        and base.weight.dtype == dtype
        and base.weight.is_contiguous()
    )
