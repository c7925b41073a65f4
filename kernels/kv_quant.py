"""The KV cache's FP8 rounding (SGLang's ``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``) and the
pure-torch scatter of new tokens' K and V, torch only: the CPU path imports this without
Triton (:mod:`kvflow.kernels.kv_store` holds the Triton scatter).

A pool of a float8 dtype stores ``clamp(x / scale, -max, max)`` cast to it (float32 math,
``max`` the format's largest finite value) and is read as ``stored.to(dtype) * scale``;
``scale`` is one float per layer for K and one for V. Pools of any other dtype store
``x.to(dtype)`` and ignore the scales.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_KV_DTYPES",
    "dequantize_kv",
    "is_fp8",
    "quantize_kv",
    "select_rows",
    "store_kv_cache_ref",
]

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a pool of ``dtype`` stores FP8 with scales."""
    return dtype in FP8_KV_DTYPES


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)  # e4m3fn 448, e5m2 57344


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a pool of ``dtype`` stores it (see the module docstring)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = _fp8_max(dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads from ``stored`` pool values: ``stored.to(dtype) * scale`` for
    FP8, else ``stored.to(dtype)``."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return stored.to(dtype) * scale


def select_rows(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buffer.index_select(0, index)``; one-byte (FP8) buffers through a ``uint8`` view,
    as not every device's indexing kernels take float8 types."""
    if buffer.element_size() != 1:
        return buffer.index_select(0, index)
    return buffer.view(torch.uint8).index_select(0, index).view(buffer.dtype)


def store_kv_cache_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Pure-torch :func:`store_kv_cache` (index assignment), in place."""
    k_buffer[loc.long()] = quantize_kv(k, k_scale, k_buffer.dtype)
    v_buffer[loc.long()] = quantize_kv(v, v_scale, v_buffer.dtype)
