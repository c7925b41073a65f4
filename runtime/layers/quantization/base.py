"""The linear-method contract: how a linear layer holds its weights and runs its matmul."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvflow.runtime.layers.activation import silu_and_mul
from kvflow.runtime.layers.moe_compute import TopK

__all__ = ["ExpertLayer", "LinearLayer", "LinearMethod", "MoEMethod", "ParamLayout"]


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter's dimension 0 and last dimension map onto the weight's output rows
    and input columns, for loading shards and tensor-parallel parts: an entry covers
    ``rows_per_entry`` rows (1: weight-shaped or per-channel; 128: a block scale; None:
    one entry per shard, a per-tensor scale) and ``cols_per_entry`` columns (None: the
    parameter is not split along the input)."""

    rows_per_entry: int | None = 1
    cols_per_entry: int | None = 1

    def entries(self, rows: int) -> int:
        """Entries along dimension 0 for a shard of ``rows`` weight rows."""
        return 1 if self.rows_per_entry is None else -(-rows // self.rows_per_entry)

    def narrow_rows(self, loaded: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """Weight rows ``[start, start + length)`` of a checkpoint tensor of this layout (a
        block scale's row covers ``rows_per_entry`` of them; a per-shard scale is whole);
        ValueError where they do not fall on whole entries."""
        per = self.rows_per_entry
        if per is None:
            return loaded
        if start % per or length % per:
            raise ValueError(
                f"rows [{start}, {start + length}) of this rank do not fall on the "
                f"checkpoint's blocks of {per} rows: choose another --tp-size"
            )
        return loaded.narrow(0, start // per, length // per)

    def narrow_cols(self, loaded: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Weight columns ``[start, end)`` of a checkpoint tensor of this layout (whole where
        the parameter is not split along the input)."""
        per = self.cols_per_entry
        if per is None:
            return loaded
        if start % per or (end - start) % per:
            raise ValueError(
                f"columns [{start}, {end}) of this rank do not fall on the checkpoint's blocks "
                f"of {per} columns: choose another --tp-size"
            )
        return loaded.narrow(-1, start // per, (end - start) // per)


class LinearLayer(Protocol):
    """What a method sees of its layer (:class:`~kvflow.runtime.layers.linear.LinearBase`):
    where to register parameters, the parameters, whether callers run the merged ``[gate;
    up]`` SwiGLU on it (``fuses_silu_mul``), where to declare a parameter that is not
    weight-shaped (``param_layouts``) or keeps its own dtype (``param_dtypes``), and the
    model's dtype (``compute_dtype``, set by the loader before loading)."""

    fuses_silu_mul: bool
    weight: nn.Parameter
    bias: nn.Parameter | None
    output_sizes: tuple[int, ...]
    param_layouts: dict[str, ParamLayout]
    param_dtypes: dict[str, torch.dtype]
    compute_dtype: torch.dtype

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...


class LinearMethod(ABC):
    """The weight layout and the matmul of a linear layer (SGLang's ``quant_method``). One instance may serve every layer of a model: what a
    method creates lives on the layer, not on the method.

    Lifecycle, driven by the layer and the model loader:

    1. :meth:`create_weights`, from the layer's ``__init__`` (under ``torch.device("meta")``
       when the loader builds the model): registers the layer's parameters. A layer of
       ``input_size`` K and ``output_sizes`` [N0, N1, ...] (the shards a checkpoint stores
       separately, stacked along the output dimension, N = sum) computes ``[..., K] ->
       [..., N]``. Parameters are created in the default dtype and cast to the model's
       dtype by the loader, except those named in the layer's ``param_dtypes``; a
       parameter that is not weight-shaped is declared in ``param_layouts``. Attributes
       set on parameters do not survive the loader's move off ``meta``: keep per-layer
       state on the layer.
    2. The loader moves the model to its device and dtype, then fills every parameter
       through the layer's ``weight_loader`` (shard ``i`` goes to rows
       ``[N0 + ... + N(i-1), ... + Ni)`` of dimension 0) or with dummy values.
    3. :meth:`process_weights_after_loading`, once per layer after every weight is in
       place and before the first forward: derives what :meth:`apply` runs on (packed
       copies, quantized weights, scales). Loading weights again afterwards needs another
       call.
    4. :meth:`apply` on every forward.

    Formats are siblings of :class:`UnquantizedLinearMethod` (one module per format under
    ``runtime/layers/quantization/``, registered in ``LINEAR_METHODS``); tensor-parallel
    sharding does not go here but into the layer classes (which rows of the checkpoint a
    rank loads, and the all-reduce of a row-parallel layer).
    """

    @abstractmethod
    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
    ) -> None:
        """Register the layer's parameters (``bias``: a bias of ``[sum(output_sizes)]``)."""

    def process_weights_after_loading(self, layer: LinearLayer) -> None:  # noqa: B027
        """Derive the tensors :meth:`apply` runs on from the loaded parameters (default:
        nothing)."""

    @abstractmethod
    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b``: ``x`` ``[..., input_size]`` -> ``[..., sum(output_sizes)]``."""

    def apply_silu_mul(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a merged ``[gate; up]`` layer's output: ``[..., N // 2]``
        (default: :meth:`apply`, then the activation; a method may fuse them)."""
        return silu_and_mul(self.apply(layer, x))


class ExpertLayer(Protocol):
    """What a :class:`MoEMethod` sees of one stacked projection of every expert
    (:class:`~kvflow.runtime.layers.moe.ExpertWeights`): as :class:`LinearLayer`, with every
    parameter stacked over the experts along a new dimension 0 (``weight`` ``[E, N, K]``;
    a layout in ``param_layouts`` describes the dimensions after it)."""

    weight: nn.Parameter
    output_sizes: tuple[int, ...]
    param_layouts: dict[str, ParamLayout]
    param_dtypes: dict[str, torch.dtype]
    compute_dtype: torch.dtype

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...


class MoEMethod(ABC):
    """The weight format and the computation of a mixture's experts (SGLang's
    ``FusedMoEMethodBase``): two stacked projections, ``w13`` (``[gate; up]`` of every
    expert, ``output_sizes`` (I, I)) and ``w2`` (down, ``output_sizes`` (H,)).

    The lifecycle is :class:`LinearMethod`'s: :meth:`create_weights` once per projection
    (on ``meta``), the loader fills each parameter through the projection's
    ``weight_loader`` (shard ``(expert, part)``: dimension 0 picks the expert, then rows as
    in a linear layer), :meth:`process_weights_after_loading` once per projection, then
    :meth:`apply` on every forward with both projections. One instance may serve every
    layer: state lives on the projections.
    """

    @abstractmethod
    def create_weights(
        self, layer: ExpertLayer, num_experts: int, input_size: int, output_sizes: Sequence[int]
    ) -> None:
        """Register the projection's parameters (``weight`` ``[num_experts, sum(output_sizes),
        input_size]`` or its quantized form and scales)."""

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:  # noqa: B027
        """Derive what :meth:`apply` runs on from the loaded parameters (default: nothing)."""

    @abstractmethod
    def apply(
        self,
        w13: ExpertLayer,
        w2: ExpertLayer,
        hidden: torch.Tensor,
        topk: TopK,
    ) -> torch.Tensor:
        """``sum_k topk.weights[t, k] * expert_{topk.ids[t, k]}(hidden[t])``, the expert
        being ``w2[e] @ silu_and_mul(w13[e] @ x)``: ``[tokens, H]`` -> ``[tokens, H]`` (this
        rank's partial sum under tensor parallelism)."""
