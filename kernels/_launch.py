"""Launch helpers shared by the kernels: interpreter detection, block sizes, dot precision.

Triton decides at ``@triton.jit`` time whether a kernel is compiled for the GPU or run by
its CPU interpreter (``TRITON_INTERPRET=1`` set before ``kvflow.kernels`` is imported).
The wrappers ask the kernel object itself, so one process never mixes the two modes.
"""

from __future__ import annotations

import functools

import torch
import triton

__all__ = ["dot_precision", "is_interpreted", "multiprocessor_count", "next_power_of_2"]


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` runs under Triton's CPU interpreter instead of being compiled."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def next_power_of_2(value: int) -> int:
    """Smallest power of two that is >= ``value`` (and >= 1)."""
    return triton.next_power_of_2(max(int(value), 1))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 for fp32 inputs (no silent TF32), else native."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of one CUDA device (cached; no host-device sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
