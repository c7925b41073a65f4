"""Sparse mixture of experts: a replicated router picks ``top_k`` SwiGLU experts per token.

Every expert's weights are stacked in two projections, ``w13`` ``[num_experts, 2 *
intermediate, hidden]`` (gate rows, then up rows) and ``w2`` ``[num_experts, hidden,
intermediate]``, filled from a checkpoint's per-expert tensors by
:meth:`ExpertWeights.weight_loader`. Their format and computation come from a
:class:`~kvflow.runtime.layers.quantization.MoEMethod` (default unquantized; FP8 experts
hold FP8 weights and their scales, each stacked over the experts). With ``tp``, each rank
holds its part of every expert's intermediate width (rows of gate and up, columns of
down, and the scales that go with them) and the block all-reduces its output once, as the
dense MLP does; no expert parallelism. The computation itself is ``moe_compute.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.layers.linear import ReplicatedLinear
from kvflow.runtime.layers.moe_compute import TopK, select_experts
from kvflow.runtime.layers.quantization import MoEMethod, ParamLayout, UnquantizedMoEMethod

__all__ = ["ExpertWeights", "Experts", "SparseMoE"]


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: ``weight`` ``[num_experts, sum(output_sizes),
    input_size]`` and whatever else ``method`` registers (each parameter stacked over the
    experts, its layout after dimension 0 in ``param_layouts``, as in
    :class:`~kvflow.runtime.layers.linear.LinearBase`). Shard ``(expert, part)`` is expert
    ``expert``'s checkpoint tensor for rows ``[sum(output_sizes[:part]), ...)``. With
    ``tp``, ``split_dim`` of each checkpoint tensor is divided among the ranks (0: rows,
    the column-parallel gate and up; 1: columns, the row-parallel down)."""

    weight: nn.Parameter

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_sizes: Sequence[int],
        split_dim: int,
        tp: TPGroup | None = None,
        method: MoEMethod | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.split_dim, self.num_experts = tp, split_dim, num_experts
        size = tp.size if tp else 1
        if split_dim == 0:
            output_sizes = [n // size for n in output_sizes]
        else:
            input_size //= size
        self.input_size, self.output_sizes = input_size, tuple(output_sizes)
        self.shard_ids = tuple((e, p) for e in range(num_experts) for p in range(len(output_sizes)))
        self.compute_dtype = torch.get_default_dtype()  # the loader sets the model's
        self.set_method(method if method is not None else UnquantizedMoEMethod())

    def set_method(self, method: MoEMethod) -> None:
        """Make ``method`` this projection's: its parameters replace the current ones."""
        for name in list(self._parameters):
            del self._parameters[name]
        self.param_layouts: dict[str, ParamLayout] = {}
        self.param_dtypes: dict[str, torch.dtype] = {}
        self.method = method
        method.create_weights(self, self.num_experts, self.input_size, self.output_sizes)

    def layout_of(self, param: nn.Parameter) -> ParamLayout:
        for name, own in self._parameters.items():
            if own is param:
                return self.param_layouts.get(name, ParamLayout())
        raise KeyError("not a parameter of this projection")

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]
    ) -> None:
        """Copy this rank's part of one expert's checkpoint tensor (a weight or a scale,
        cut along its layout) into that expert's entries of ``param``."""
        expert, part = shard_id
        layout = self.layout_of(param)
        if self.tp is not None:
            if self.split_dim == 0:
                local = self.output_sizes[part]
                loaded = layout.narrow_rows(loaded, self.tp.rank * local, local)
            else:
                start = self.tp.rank * self.input_size
                loaded = layout.narrow_cols(loaded, start, start + self.input_size)
        if layout.rows_per_entry is None:  # one entry per part: a per-tensor scale
            offset, length = part, 1
        else:
            entries = [layout.entries(n) for n in self.output_sizes]
            offset, length = sum(entries[:part]), entries[part]
        target = param.data[expert].narrow(0, offset, length)
        if target.shape != loaded.shape and target.numel() == loaded.numel() == 1:
            loaded = loaded.reshape(target.shape)  # a scalar scale saved as [] or [1]
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert {expert} part {part}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)


class Experts(nn.Module):
    """``w13`` (shards ``(e, 0)`` gate, ``(e, 1)`` up) and ``w2`` (shard ``(e, 0)``), run by
    one ``method``: ``(hidden [tokens, H], topk) -> [tokens, H]``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup | None,
        method: MoEMethod | None = None,
    ) -> None:
        super().__init__()
        self.method = method if method is not None else UnquantizedMoEMethod()
        inter = intermediate_size
        self.w13 = ExpertWeights(num_experts, hidden_size, [inter, inter], 0, tp, self.method)
        self.w2 = ExpertWeights(num_experts, inter, [hidden_size], 1, tp, self.method)

    def set_method(self, method: MoEMethod) -> None:
        """Make ``method`` the experts' (before loading, on ``meta``)."""
        self.method = method
        self.w13.set_method(method)
        self.w2.set_method(method)

    def forward(self, hidden: torch.Tensor, topk: TopK) -> torch.Tensor:
        return self.method.apply(self.w13, self.w2, hidden, topk)


class SparseMoE(nn.Module):
    """``gate`` (the router, replicated and never quantized, as in SGLang) ->
    :func:`select_experts` -> the experts -> one all-reduce under ``tp``: ``[tokens,
    hidden]`` -> same."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.tp = top_k, renormalize, tp
        self.gate = ReplicatedLinear(hidden_size, num_experts, False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        out = self.experts(hidden, topk)
        return out if self.tp is None else self.tp.all_reduce(out)
