"""When the layers take kvflow's native CPU kernels (:mod:`kvflow.kernels.cpu`)."""

from __future__ import annotations

import torch

from kvflow.kernels import cpu

__all__ = ["cpu_kernels_take"]


def cpu_kernels_take(*operands: torch.Tensor) -> bool:
    """The native kernels are on (built here, not switched off) and take these operands."""
    return cpu.elementwise.supports(*operands) and cpu.available()
