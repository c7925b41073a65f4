"""Scatter of new tokens' K and V into the KV pool at their token slots (Triton), with the
KV cache's FP8 rounding of :mod:`kvflow.kernels.kv_quant` (which also holds the reference).

A pool of a float8 dtype stores ``clamp(x / scale, -max, max)`` cast to it (float32 math,
``max`` the format's largest finite value) and is read as ``stored.to(dtype) * scale``;
``scale`` is one float per layer for K and one for V. Pools of any other dtype store
``x.to(dtype)`` and ignore the scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import next_power_of_2
from kvflow.kernels.kv_quant import _fp8_max, is_fp8

__all__ = ["store_kv_cache"]


@triton.jit
def _store_kv_kernel(
    k_buf_ptr, v_buf_ptr, loc_ptr, k_ptr, v_ptr, k_scale, v_scale,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + token).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    if FP8_MAX > 0:  # an FP8 pool: round x / scale (IEEE division, as the torch reference)
        k = tl.math.div_rn(k.to(tl.float32), k_scale)
        v = tl.math.div_rn(v.to(tl.float32), v_scale)
        k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    k_dst = k_buf_ptr + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :]
    v_dst = v_buf_ptr + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(k_dst, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``k``, ``v`` [tokens, num_kv_heads, head_dim] into ``k_buffer``, ``v_buffer``
    [num_token_slots, num_kv_heads, head_dim] at token slots ``loc`` [tokens] (int32 or
    int64, distinct), as :func:`~kvflow.kernels.kv_quant.quantize_kv` rounds them to the buffers' dtype (the scales
    matter for FP8 buffers only; under a CUDA graph they are fixed at capture). Last dims
    must be contiguous."""
    tokens, num_heads, head_dim = k.shape
    if tokens == 0:
        return
    block_d = next_power_of_2(head_dim)
    block_h = max(1, min(next_power_of_2(num_heads), 2048 // block_d))
    grid = (tokens, triton.cdiv(num_heads, block_h))
    fp8_max = _fp8_max(k_buffer.dtype) if is_fp8(k_buffer.dtype) else 0.0
    _store_kv_kernel[grid](
        k_buffer, v_buffer, loc, k, v, float(k_scale), float(v_scale),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, FP8_MAX=fp8_max, num_warps=4,
    )  # fmt: skip
