"""SwiGLU's activation: ``silu(gate) * up`` over a merged ``[tokens, 2 * intermediate]`` tensor."""

from __future__ import annotations

import torch

from kvflow import kernels
from kvflow.kernels import cpu
from kvflow.runtime.layers.cpu_kernels import cpu_kernels_take

__all__ = ["silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:
        return kernels.silu_and_mul(gate_up)
    if gate_up.dim() == 2 and cpu_kernels_take(gate_up):
        return cpu.elementwise.silu_and_mul(gate_up)
    return kernels.silu_and_mul_ref(gate_up)
