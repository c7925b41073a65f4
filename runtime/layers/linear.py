"""Projections of the native models: one-token inputs on CUDA take the Triton GEMV; on CPU,
weights prepacked once in oneDNN's blocked layout (:func:`pack_linears`) skip the per-call
reorder that ``F.linear`` pays.

Measured on the 2-core EPYC (SmolLM2-135M's projections, ``benchmarks/results/cpu-kernels.md``):
prepacked is 1.1-1.4x ``F.linear`` in bfloat16 and 1.4-2.4x in float32 at 32 rows (a decode
step), 1.05-1.2x at 2048 rows (a prefill chunk). The packed copy is kept beside the weight
(which loading, the embedding of tied heads and other devices still read): CPU weights
take twice their memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels

__all__ = ["linear", "matmul_weight", "pack_linears", "pack_weight"]

PACKABLE = (torch.float32, torch.bfloat16)
# oneDNN picks the blocked layout for an expected row count; decode batches are the
# steady state and the layout chosen for them is as fast for prefill chunks too.
PACK_ROWS_HINT = 32
_PACKED = "kvflow_packed_weight"


def _one_row(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] reordered for oneDNN's linear, or None where that does not apply
    (not on CPU, another dtype, torch built without oneDNN)."""
    usable = weight.device.type == "cpu" and weight.dtype in PACKABLE and weight.dim() == 2
    if not usable or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


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


def _packed_matmul(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _takes(packed: torch.Tensor, x: torch.Tensor) -> bool:
    return x.dtype == packed.dtype and x.device.type == "cpu"


def matmul_weight(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for ``weight`` [N, K]: a single row ``x`` [1, K] on CUDA streams the
    weight once with :func:`kvflow.kernels.gemv` (faster than cuBLAS at M=1 on H100); a CPU
    ``x`` uses ``packed`` (:func:`pack_weight` of ``weight``) when given; everything else
    goes to ``F.linear``."""
    if _one_row(x):
        return kernels.gemv(x, weight)
    if packed is not None and _takes(packed, x):
        return _packed_matmul(x, packed, None)
    return F.linear(x, weight)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``: a single CUDA row through :func:`kvflow.kernels.gemv`, a CPU row block
    through the weight :func:`pack_linears` attached."""
    packed: torch.Tensor | None = layer.__dict__.get(_PACKED)
    if packed is not None and _takes(packed, x):
        return _packed_matmul(x, packed, layer.bias)
    if not _one_row(x):
        return layer(x)
    out = kernels.gemv(x, layer.weight)
    return out if layer.bias is None else out + layer.bias
