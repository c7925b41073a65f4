"""RMSNorm with an optional fused residual add, numerically as Hugging Face Llama."""

from __future__ import annotations

import torch
from torch import nn

from kvflow import kernels

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed; ``forward(x, residual)`` -> (normed(x + residual), x + residual).

    CUDA runs one fused Triton kernel; elsewhere the kernel's pure-torch reference (the
    Hugging Face computation: float32 inside, cast back before the weight).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        norm = kernels.rmsnorm if x.is_cuda else kernels.rmsnorm_ref
        return norm(x, self.weight, self.eps, residual)
