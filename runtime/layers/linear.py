"""Linear layers by weight layout; their weights and matmul come from a :class:`LinearMethod`.

A layer knows where each checkpoint tensor goes (:meth:`LinearBase.weight_loader`); its
method knows what the weights are and how they run. Tensor parallelism adds sibling
classes here (column-parallel merged and QKV layers whose ``weight_loader`` keeps the
rank's rows, a row-parallel one that splits the input and all-reduces in ``forward``);
quantized formats add methods (``runtime/layers/quantization/``), not layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvflow.runtime.layers.quantization import LinearMethod, UnquantizedLinearMethod

__all__ = ["GateUpLinear", "LinearBase", "MergedColumnLinear", "QKVLinear", "ReplicatedLinear"]

ShardId = int | str | None


class LinearBase(nn.Module):
    """``x`` ``[..., input_size]`` -> ``[..., output_size]``, with ``output_size`` the sum of
    ``output_sizes``: the shards a checkpoint stores as separate tensors, stacked in order
    along the output dimension and named by ``shard_ids`` (one ``None`` for a single
    tensor). ``method`` (default unquantized) creates the parameters and runs the matmul."""

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
        self.method = method if method is not None else UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, self.output_sizes, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy a checkpoint tensor into ``param``: the whole of it (``shard_id`` None), or
        the rows of dimension 0 that shard ``shard_id`` owns."""
        target = param.data
        if shard_id is not None:
            if shard_id not in self.shard_ids:
                raise KeyError(f"no shard {shard_id!r} in {self.shard_ids}")
            index = self.shard_ids.index(shard_id)
            offset = sum(self.output_sizes[:index])
            target = target.narrow(0, offset, self.output_sizes[index])
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class ReplicatedLinear(LinearBase):
    """One weight ``[output_size, input_size]``, loaded whole."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, method: LinearMethod | None = None
    ) -> None:
        super().__init__(input_size, [output_size], bias, method)


class MergedColumnLinear(LinearBase):
    """Several projections of the same input, stacked along the output: shard ``i`` (an
    int) fills rows ``[sum(output_sizes[:i]), sum(output_sizes[:i + 1]))``."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        method: LinearMethod | None = None,
    ) -> None:
        shard_ids = range(len(output_sizes))
        super().__init__(input_size, output_sizes, bias, method, shard_ids)


class GateUpLinear(MergedColumnLinear):
    """SwiGLU's ``[gate; up]`` (shards 0 and 1, each ``intermediate_size`` rows);
    :meth:`silu_mul` gives ``silu(gate) * up``."""

    fuses_silu_mul = True

    def __init__(
        self, input_size: int, intermediate_size: int, method: LinearMethod | None = None
    ) -> None:
        super().__init__(input_size, [intermediate_size, intermediate_size], False, method)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., input_size]`` -> ``[..., intermediate_size]``."""
        return self.method.apply_silu_mul(self, x)


class QKVLinear(LinearBase):
    """Attention's ``[q; k; v]`` (shards ``"q"``, ``"k"``, ``"v"``): ``num_heads`` query
    heads and ``num_kv_heads`` key and value heads of ``head_dim`` each."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        method: LinearMethod | None = None,
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, method, ("q", "k", "v"))
