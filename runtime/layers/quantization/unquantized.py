"""Weights as the checkpoint stores them, in the model's dtype: of linear layers and of a
mixture's experts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels
from kvflow.runtime.layers.matmul import PackedWeight, one_row, pack_weight
from kvflow.runtime.layers.moe_compute import TopK, fused_experts
from kvflow.runtime.layers.quantization.base import (
    ExpertLayer,
    LinearLayer,
    LinearMethod,
    MoEMethod,
)

__all__ = ["UnquantizedLinearMethod", "UnquantizedMoEMethod", "release_float_weights"]

_PACKED = "packed_weight"


class UnquantizedLinearMethod(LinearMethod):
    """``weight`` ``[N, K]`` and ``bias`` ``[N]`` as ``nn.Linear`` holds them.

    After loading, a CPU weight is packed (:func:`~kvflow.runtime.layers.matmul.pack_weight`)
    into the layer's ``packed_weight``, for the fused SwiGLU where the layer's
    ``fuses_silu_mul`` says so. :meth:`apply` runs a CPU row block through the packed copy,
    a single CUDA row through the Triton GEMV, everything else through ``F.linear``.
    """

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
    ) -> None:
        output_size = sum(output_sizes)
        weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.register_parameter("weight", weight)
        bias_param = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        layer.register_parameter("bias", bias_param)
        setattr(layer, _PACKED, None)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        fused = layer.fuses_silu_mul and layer.bias is None
        setattr(layer, _PACKED, pack_weight(layer.weight, silu_mul=fused))

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        packed: PackedWeight | None = layer.__dict__[_PACKED]
        if packed is not None and packed.takes(x) and packed.plain_for(x):
            return packed.matmul(x, layer.bias)
        if not one_row(x):
            return F.linear(x, layer.weight, layer.bias)
        out = kernels.gemv(x, layer.weight)
        return out if layer.bias is None else out + layer.bias

    def apply_silu_mul(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        """One native matmul with the activation applied as it writes, where the weight was
        packed for it (the ``[tokens, 2 * intermediate]`` product is never materialized)."""
        packed: PackedWeight | None = layer.__dict__[_PACKED]
        if packed is not None and packed.silu_mul and packed.takes(x) and packed.native_for(x):
            return packed.silu_mul_matmul(x)
        return super().apply_silu_mul(layer, x)


def release_float_weights(model: nn.Module) -> int:
    """Frees the float ``weight`` of every unquantized projection whose packed copy runs all
    its CPU inputs (native panels, no oneDNN layout: bfloat16), leaving a zero-element
    parameter of the same dtype in its place, so that a path still reading it fails loudly.
    Returns the bytes freed. Only for a model without LoRA: an adapter's delta joins the
    plain product of a merged ``[gate; up]`` (:class:`~kvflow.runtime.lora.layers.LoraLinear`),
    which the SwiGLU-packed panels cannot give."""
    freed = 0
    for module in model.modules():
        packed = module.__dict__.get(_PACKED)
        if (
            not isinstance(packed, PackedWeight)
            or packed.native is None
            or packed.onednn is not None
        ):
            continue
        if not isinstance(getattr(module, "method", None), UnquantizedLinearMethod):
            continue
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        freed += weight.numel() * weight.element_size()
        empty = torch.empty(0, dtype=weight.dtype, device=weight.device)
        module.weight = nn.Parameter(empty, requires_grad=False)
    return freed


class UnquantizedMoEMethod(MoEMethod):
    """``weight`` ``[E, N, K]`` per projection, run by
    :func:`~kvflow.runtime.layers.moe_compute.fused_experts` (the fused Triton kernel on
    CUDA, the grouped loop on CPU)."""

    def create_weights(
        self, layer: ExpertLayer, num_experts: int, input_size: int, output_sizes: Sequence[int]
    ) -> None:
        weight = torch.empty(num_experts, sum(output_sizes), input_size)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def apply(
        self, w13: ExpertLayer, w2: ExpertLayer, hidden: torch.Tensor, topk: TopK
    ) -> torch.Tensor:
        return fused_experts(hidden, w13.weight, w2.weight, topk)
