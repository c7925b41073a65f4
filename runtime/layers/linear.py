"""Projections of the native models: one-token inputs on CUDA take the Triton GEMV."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels

__all__ = ["linear", "matmul_weight"]


def _one_row(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1


def matmul_weight(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``weight`` [N, K]: a single row ``x`` [1, K] on CUDA streams the
    weight once with :func:`kvflow.kernels.gemv` (faster than cuBLAS at M=1 on H100);
    everything else goes to ``F.linear``."""
    return kernels.gemv(x, weight) if _one_row(x) else F.linear(x, weight)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, with a single CUDA row through :func:`kvflow.kernels.gemv`."""
    if not _one_row(x):
        return layer(x)
    out = kernels.gemv(x, layer.weight)
    return out if layer.bias is None else out + layer.bias
