"""Gated activations over a merged ``[tokens, 2 * intermediate]`` tensor (gate first, up
second): SwiGLU's ``silu(gate) * up``, GeGLU's ``gelu_tanh(gate) * up`` (Gemma)."""

from __future__ import annotations

import torch

from kvflow import kernels
from kvflow.kernels import cpu
from kvflow.runtime.layers.cpu_kernels import cpu_kernels_take

__all__ = ["gelu_tanh_and_mul", "silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:
        return kernels.silu_and_mul(gate_up)
    if gate_up.dim() == 2 and cpu_kernels_take(gate_up):
        return cpu.elementwise.silu_and_mul(gate_up)
    return kernels.silu_and_mul_ref(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (transformers' ``gelu_pytorch_tanh``): the
    Triton kernel on CUDA, torch elsewhere."""
    if gate_up.is_cuda and gate_up.dim() == 2:
        return kernels.gelu_tanh_and_mul(gate_up)
    return kernels.gelu_tanh_and_mul_ref(gate_up)
