"""RMSNorm with an optional fused residual add, numerically as Hugging Face Llama."""

from __future__ import annotations

import torch
from torch import nn

from kvflow import kernels

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed; ``forward(x, residual)`` -> (normed(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 and cast back before the weight, like transformers' LlamaRMSNorm.
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:  # one fused Triton kernel (add + norm) instead of ~8 small ones
            return kernels.rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
