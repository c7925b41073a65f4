"""Linear layers by weight layout; their weights and matmul come from a :class:`LinearMethod`.

A layer knows where each checkpoint tensor goes (:meth:`LinearBase.weight_loader`); its
method knows what the weights are and how they run. Under tensor parallelism (a
:class:`~kvflow.runtime.distributed.TPGroup` given as ``tp``) the merged and QKV layers
are column-parallel (each rank keeps its rows of every shard: its heads, its part of the
MLP width) and :class:`RowParallelLinear` splits the input and all-reduces in
``forward``; quantized formats add methods (``runtime/layers/quantization/``), not layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvflow.runtime.distributed import ShardedHeads, TPGroup, shard_range
from kvflow.runtime.layers.quantization import LinearMethod, ParamLayout, UnquantizedLinearMethod

__all__ = [
    "GateUpLinear",
    "LinearBase",
    "MergedColumnLinear",
    "QKVLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
]

ShardId = int | str | None


class LinearBase(nn.Module):
    """``x`` ``[..., input_size]`` -> ``[..., output_size]``, with ``output_size`` the sum of
    ``output_sizes``: the shards a checkpoint stores as separate tensors, stacked in order
    along the output dimension and named by ``shard_ids`` (one ``None`` for a single
    tensor). ``method`` (default unquantized) creates the parameters and runs the matmul.

    A method may register parameters that are not weight-shaped (a quantized format's
    scales): ``param_layouts`` says how each maps onto the weight's rows and columns
    (:class:`~kvflow.runtime.layers.quantization.ParamLayout`; absent: weight-shaped), so
    loading and tensor-parallel slicing place every checkpoint tensor; ``param_dtypes``
    names the parameters kept in their own dtype (FP8 weights, float32 scales) when the
    loader casts the model to its dtype."""

    # Callers run silu_mul() on it (a merged [gate; up]): a method may prepare for that.
    fuses_silu_mul: bool = False
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        method: LinearMethod | None = None,
        shard_ids: Sequence[ShardId] = (None,),
    ) -> None:
        super().__init__()
        if len(output_sizes) != len(shard_ids):
            raise ValueError(f"{len(output_sizes)} output sizes for shards {shard_ids}")
        self.shard_ids = tuple(shard_ids)
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.output_size = sum(output_sizes)
        self.has_bias = bias
        # the dtype activations arrive in (the loader sets the model's)
        self.compute_dtype = torch.get_default_dtype()
        self.set_method(method if method is not None else UnquantizedLinearMethod())

    def set_method(self, method: LinearMethod) -> None:
        """Make ``method`` this layer's: its parameters replace the current ones (before
        loading; on ``meta`` this costs nothing)."""
        for name in list(self._parameters):
            del self._parameters[name]
        self.param_layouts: dict[str, ParamLayout] = {}
        self.param_dtypes: dict[str, torch.dtype] = {}
        self.method = method
        method.create_weights(self, self.input_size, self.output_sizes, self.has_bias)

    def layout_of(self, param: nn.Parameter) -> ParamLayout:
        for name, own in self._parameters.items():
            if own is param:
                return self.param_layouts.get(name, ParamLayout())
        raise KeyError("not a parameter of this layer")

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy a checkpoint tensor into ``param``: the whole of it (``shard_id`` None), or
        the rows of dimension 0 that shard ``shard_id`` owns (for a per-shard scale, its
        entry); under tensor parallelism, only this rank's part of it (:meth:`rank_part`)."""
        loaded = self.rank_part(param, loaded, shard_id)
        layout = self.layout_of(param)
        target = param.data
        if shard_id is not None:
            if shard_id not in self.shard_ids:
                raise KeyError(f"no shard {shard_id!r} in {self.shard_ids}")
            index = self.shard_ids.index(shard_id)
            if layout.rows_per_entry is None:
                target = target.narrow(0, index, 1)
            else:
                entries = [layout.entries(n) for n in self.output_sizes]
                target = target.narrow(0, sum(entries[:index]), entries[index])
        if target.shape != loaded.shape and target.numel() == loaded.numel() == 1:
            loaded = loaded.reshape(target.shape)  # a scalar scale saved as [] or [1]
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def rank_part(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
    ) -> torch.Tensor:
        """The part of a whole checkpoint tensor this rank holds (all of it here)."""
        return loaded

    def narrow_rows(
        self, param: nn.Parameter, loaded: torch.Tensor, start: int, length: int
    ) -> torch.Tensor:
        """Weight rows ``[start, start + length)`` of ``loaded``, in ``param``'s units
        (:meth:`ParamLayout.narrow_rows`)."""
        return self.layout_of(param).narrow_rows(loaded, start, length)

    def narrow_cols(
        self, param: nn.Parameter, loaded: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Weight columns ``[start, end)`` of ``loaded``, in ``param``'s units
        (:meth:`ParamLayout.narrow_cols`)."""
        return self.layout_of(param).narrow_cols(loaded, start, end)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.method.apply(self, x))

    # -- a low-rank adapter's part on this rank (LoRA, kvflow.runtime.lora) ----------------
    @property
    def whole_input_size(self) -> int:
        """The input width of the whole projection (all ranks together)."""
        return self.input_size

    def whole_output_size(self, index: int) -> int:
        """The rows of shard number ``index`` in the whole projection."""
        return self.output_sizes[index]

    def lora_part(
        self, a: torch.Tensor, b: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter on shard number ``index``: ``a`` ``[r, whole
        input]`` and ``b`` ``[whole rows of the shard, r]`` cut as the weight is, so that
        ``(x @ a.T) @ b.T`` on this rank's input is this rank's part of the delta."""
        return a, b

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """What ``forward`` does to the rank's product of ``method.apply`` (nothing here;
        a row-parallel layer sums the ranks' partial products)."""
        return out


class ReplicatedLinear(LinearBase):
    """One weight ``[output_size, input_size]``, loaded whole."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, method: LinearMethod | None = None
    ) -> None:
        super().__init__(input_size, [output_size], bias, method)


class MergedColumnLinear(LinearBase):
    """Several projections of the same input, stacked along the output: shard ``i`` (an
    int) fills rows ``[sum(output_sizes[:i]), sum(output_sizes[:i + 1]))``. With ``tp``,
    ``output_sizes`` are the whole model's and each rank holds an even part of each."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        self.tp = tp
        size = tp.size if tp else 1
        local = [n // size for n in output_sizes]
        super().__init__(input_size, local, bias, method, range(len(output_sizes)))

    def rank_part(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
    ) -> torch.Tensor:
        if self.tp is None or shard_id is None:
            return loaded
        local = self.output_sizes[self.shard_ids.index(shard_id)]
        return self.narrow_rows(param, loaded, self.tp.rank * local, local)

    def whole_output_size(self, index: int) -> int:
        return self.output_sizes[index] * (self.tp.size if self.tp else 1)

    def lora_part(
        self, a: torch.Tensor, b: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp is None:
            return a, b
        local = self.output_sizes[index]
        return a, b.narrow(0, self.tp.rank * local, local)


class GateUpLinear(MergedColumnLinear):
    """SwiGLU's ``[gate; up]`` (shards 0 and 1, each ``intermediate_size`` rows);
    :meth:`silu_mul` gives ``silu(gate) * up``."""

    fuses_silu_mul = True

    def __init__(
        self,
        input_size: int,
        intermediate_size: int,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(input_size, [intermediate_size, intermediate_size], False, method, tp)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., input_size]`` -> ``[..., intermediate_size]``."""
        return self.method.apply_silu_mul(self, x)


class QKVLinear(LinearBase):
    """Attention's ``[q; k; v]`` (shards ``"q"``, ``"k"``, ``"v"``): ``num_heads`` query
    heads and ``num_kv_heads`` key and value heads of ``head_dim`` each. With ``tp``, a
    rank holds the heads :class:`~kvflow.runtime.distributed.ShardedHeads` gives it
    (``self.heads``: its counts, which attention uses)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        self.tp, self.head_dim = tp, head_dim
        rank, size = (tp.rank, tp.size) if tp else (0, 1)
        self.heads = ShardedHeads.of(num_heads, num_kv_heads, rank, size)
        self.whole_heads = (num_heads, num_kv_heads, num_kv_heads)  # q, k, v
        q_size = self.heads.num_heads * head_dim
        kv_size = self.heads.num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, method, ("q", "k", "v"))

    def rank_part(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
    ) -> torch.Tensor:
        if self.tp is None or shard_id is None:
            return loaded
        heads = self.heads
        if shard_id == "q":
            first, count = heads.first_head, heads.num_heads
        else:
            first, count = heads.first_kv_head, heads.num_kv_heads
        return self.narrow_rows(param, loaded, first * self.head_dim, count * self.head_dim)

    def whole_output_size(self, index: int) -> int:
        return self.whole_heads[index] * self.head_dim

    def lora_part(
        self, a: torch.Tensor, b: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp is None:
            return a, b
        heads = self.heads
        first = heads.first_head if index == 0 else heads.first_kv_head
        return a, b.narrow(0, first * self.head_dim, self.output_sizes[index])


class RowParallelLinear(LinearBase):
    """``[..., input_size]`` -> ``[..., output_size]`` whose input arrives split across the
    ranks of ``tp`` (the heads' outputs, the MLP's width): each rank multiplies its columns
    of the weight, and ``forward`` sums the partial products over the ranks. The bias is
    loaded on rank 0 only (zeros elsewhere), so the sum adds it once. Without ``tp`` it is
    a plain linear layer."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        self.tp = tp
        super().__init__(input_size // (tp.size if tp else 1), [output_size], bias, method)

    def rank_part(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
    ) -> torch.Tensor:
        if self.tp is None:
            return loaded
        if param is self.bias:
            return loaded if self.tp.is_first else torch.zeros_like(loaded)
        start, end = shard_range(self.input_size * self.tp.size, self.tp.rank, self.tp.size)
        return self.narrow_cols(param, loaded, start, end)

    @property
    def whole_input_size(self) -> int:
        return self.input_size * (self.tp.size if self.tp else 1)

    def lora_part(
        self, a: torch.Tensor, b: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp is None:
            return a, b
        start, end = shard_range(self.whole_input_size, self.tp.rank, self.tp.size)
        return a[:, start:end], b

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial products (an all-reduce)."""
        return out if self.tp is None else self.tp.all_reduce(out)
