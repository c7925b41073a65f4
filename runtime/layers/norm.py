"""RMSNorm with an optional fused residual add, numerically as Hugging Face Llama; Gemma's
variant (``x * (1 + w)``, all in float32)."""

from __future__ import annotations

import torch
from torch import nn

from kvflow import kernels
from kvflow.kernels import cpu
from kvflow.runtime.layers.cpu_kernels import cpu_kernels_take

__all__ = ["GemmaRMSNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed; ``forward(x, residual)`` -> (normed(x + residual), x + residual).

    CUDA runs one fused Triton kernel, CPU the native C kernel where it builds; elsewhere the
    kernel's pure-torch reference (the Hugging Face computation: float32 inside, cast back
    before the weight).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            return kernels.rmsnorm(x, self.weight, self.eps, residual)
        operands = (x, self.weight) if residual is None else (x, self.weight, residual)
        if (
            x.dim() == 2
            and x.shape[1] <= cpu.elementwise.MAX_HIDDEN
            and cpu_kernels_take(*operands)
        ):
            return cpu.elementwise.rmsnorm(x, self.weight, self.eps, residual)
        return kernels.rmsnorm_ref(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, as transformers' ``Gemma2RMSNorm``: the stored weight is an offset
    from 1 (``normed * (1 + w)``), and normalisation and scaling both run in float32, cast
    back once at the end. Same ``forward`` contract as :class:`RMSNorm` (the residual sum
    rounded to the input dtype). CUDA runs the fused Triton kernel (four norms a layer: as
    separate torch ops they were ~40 launches); elsewhere the kernel's pure-torch
    reference."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda and x.dim() == 2:
            return kernels.rmsnorm(x, self.weight, self.eps, residual, unit_offset=True)
        return kernels.rmsnorm_ref(x, self.weight, self.eps, residual, unit_offset=True)
