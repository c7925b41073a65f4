"""A linear layer with the batch's LoRA deltas added to its output."""

from __future__ import annotations

import torch
from torch import nn

from kvflow.runtime.layers import LinearBase, silu_and_mul
from kvflow.runtime.lora.batch import LoraBatch

__all__ = ["LoraContext", "LoraLinear"]


class LoraContext:
    """The adapter layout of the forward being run (``batch``, None: no adapter in it),
    shared by every :class:`LoraLinear` of a model; set for one forward by
    :meth:`~kvflow.runtime.lora.LoraManager.active`. ``shrink_stream``: the CUDA stream
    the layers' shrinks are captured on in CUDA graphs, beside their base projections
    (None: one stream)."""

    def __init__(self, shrink_stream: torch.cuda.Stream | None = None) -> None:
        self.batch: LoraBatch | None = None
        self.shrink_stream = shrink_stream


class LoraLinear(nn.Module):
    """Wraps a projection (``base``, any :class:`LinearBase`, any weight method): ``y =
    base(x) + scaling * (x @ A.T) @ B.T`` per request's adapter. Under tensor parallelism
    the slots hold this rank's part of each adapter (B's rows of a column-parallel
    projection, A's columns of a row-parallel one).

    Each of the layer's shards (q, k, v of a merged QKV; gate, up) gets ``max_rank`` rows
    of the stacked ``A`` and columns of ``B``: ``a_slots`` ``[slots, shards * max_rank,
    input_size]``, ``b_slots`` ``[slots, output_size, shards * max_rank]``, B block-diagonal
    over the shards, zero where an adapter's rank or targets leave room (the kernels read
    each shard's block only up to the slot's rank, and B only on its diagonal)."""

    def __init__(
        self,
        base: LinearBase,
        context: LoraContext,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.max_rank = max_rank
        self.output_sizes: tuple[int, ...] = tuple(base.output_sizes)
        width = len(base.output_sizes) * max_rank
        self.a_slots = torch.zeros(num_slots, width, base.input_size, dtype=dtype, device=device)
        self.b_slots = torch.zeros(num_slots, base.output_size, width, dtype=dtype, device=device)

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
        """The base projection plus the delta. While a CUDA graph is captured (the decode
        steps) with a shrink stream, the shrink (``x @ A.T``, a few small kernels that leave
        most of the GPU idle) is captured on it, beside the base projection on the current
        stream, which waits for it before the expand adds the delta: two parallel branches
        of the graph. Eager forwards (prefills: their projections fill the GPU) run both
        on one stream."""
        batch = self.context.batch
        if batch is None:
            return self.base(x)
        shards = len(self.output_sizes)
        side = self.context.shrink_stream
        if side is None or not torch.cuda.is_current_stream_capturing():
            out = self.base.method.apply(self.base, x)
            h = batch.shrink(x, self.a_slots, shards)
        else:
            # NOTE: every use of the side stream starts by waiting for the current one, so
            # ``h`` (allocated there, freed here after the expand is queued) is never reused
            # on the side stream before the expand has read it
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                h = batch.shrink(x, self.a_slots, shards)
            out = self.base.method.apply(self.base, x)
            main.wait_stream(side)
        # NOTE: a row-parallel projection's delta joins its partial product before the
        # all-reduce (this rank's input columns times its columns of A), summed with it
        out = batch.expand(h, out, self.b_slots, self.output_sizes)
        return self.base.reduce(out)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A merged ``[gate; up]``'s ``silu(gate) * up`` (the delta is added before it)."""
        if self.context.batch is None:
            return self.base.silu_mul(x)  # type: ignore[operator]
        return silu_and_mul(self.forward(x))
