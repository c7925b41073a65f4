"""The linear-method contract: how a linear layer holds its weights and runs its matmul."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvflow.runtime.layers.activation import silu_and_mul

__all__ = ["LinearLayer", "LinearMethod", "ParamLayout"]


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
