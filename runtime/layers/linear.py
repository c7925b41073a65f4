"""Projections of the native models: one-token inputs on CUDA take the Triton GEMV; on CPU,
weights packed once (:func:`pack_linears`) run through kvflow's native matmul
(:mod:`kvflow.kernels.cpu.gemm`) and/or oneDNN's prepacked linear, skipping the per-call
reorder that ``F.linear`` pays.

Which CPU path runs (measured on the 2-core EPYC with SmolLM2-135M's projections, 30 layers
plus the head, ``benchmarks/results/cpu-kernels.md``): bfloat16 takes the native kernel at
every row count (1.2-1.3x oneDNN at 32 rows, a decode step; on par at 2048); float32 takes
it up to :data:`NATIVE_MAX_ROWS` rows (1.1-1.4x at 32) and oneDNN above (~10% faster than
the native kernel for prefill chunks), so a float32 weight keeps both packed copies. The
packed copies sit beside the weight (which loading, the embedding of tied heads and other
devices still read): a CPU weight takes two (bfloat16) or three (float32) times its memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels
from kvflow.kernels import cpu

__all__ = [
    "NATIVE_MAX_ROWS",
    "PackedWeight",
    "linear",
    "matmul_weight",
    "pack_linears",
    "pack_weight",
]

ONEDNN_TYPES = (torch.float32, torch.bfloat16)
# oneDNN picks the blocked layout for an expected row count; decode batches are the
# steady state and the layout chosen for them is as fast for prefill chunks too.
PACK_ROWS_HINT = 32
NATIVE_MAX_ROWS = 128  # float32 row blocks above this go to oneDNN when it is packed
_PACKED = "kvflow_packed_weight"


@dataclass(frozen=True)
class PackedWeight:
    """A CPU weight ``[out_features, K]`` packed for the matmuls that run it: the native
    kernel's panels and/or oneDNN's blocked layout (at least one is set)."""

    out_features: int
    dtype: torch.dtype
    native: torch.Tensor | None
    onednn: torch.Tensor | None

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.device.type == "cpu"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for ``x`` ``[..., K]`` of the packed dtype on CPU."""
        rows = x.reshape(-1, x.shape[-1])
        if self.native is not None and (self.onednn is None or rows.shape[0] <= NATIVE_MAX_ROWS):
            out = cpu.gemm.gemm(
                rows if rows.stride(1) == 1 else rows.contiguous(), self.native, self.out_features
            )
            if bias is not None:
                out += bias
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.onednn, bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def _one_row(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` [N, K] packed for CPU matmuls (see the module docstring for which layouts),
    or None where neither applies (not on CPU, another dtype, no native kernels and torch
    built without oneDNN)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    native = None
    if cpu.available() and cpu.gemm.supports(weight):
        native = cpu.gemm.pack(weight.detach())
    onednn = None
    wants_onednn = native is None or weight.dtype == torch.float32
    if wants_onednn and weight.dtype in ONEDNN_TYPES and torch.backends.mkldnn.is_available():
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    if native is None and onednn is None:
        return None
    return PackedWeight(weight.shape[0], weight.dtype, native, onednn)


def pack_linears(model: nn.Module) -> int:
    """Attach a packed weight to every packable ``nn.Linear`` of ``model``; returns how many.
    Call after the weights are loaded (a packed weight is a copy)."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            packed = pack_weight(module.weight)
            if packed is not None:
                setattr(module, _PACKED, packed)
                count += 1
    return count


def matmul_weight(
    x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for ``weight`` [N, K]: a single row ``x`` [1, K] on CUDA streams the
    weight once with :func:`kvflow.kernels.gemv` (faster than cuBLAS at M=1 on H100); a CPU
    ``x`` uses ``packed`` (:func:`pack_weight` of ``weight``) when given; everything else
    goes to ``F.linear``."""
    if _one_row(x):
        return kernels.gemv(x, weight)
    if packed is not None and packed.takes(x):
        return packed.matmul(x)
    return F.linear(x, weight)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``: a single CUDA row through :func:`kvflow.kernels.gemv`, a CPU row block
    through the weight :func:`pack_linears` attached."""
    packed: PackedWeight | None = layer.__dict__.get(_PACKED)
    if packed is not None and packed.takes(x):
        return packed.matmul(x, layer.bias)
    if not _one_row(x):
        return layer(x)
    out = kernels.gemv(x, layer.weight)
    return out if layer.bias is None else out + layer.bias
