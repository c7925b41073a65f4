"""Rotary position embedding applied in place to q and k (NeoX / HF Llama layout).

With ``x1, x2`` the first and second halves of a head and ``cos, sin`` the halves of
``cos_sin_cache[position]``: ``x1' = x1 cos - x2 sin`` and ``x2' = x2 cos + x1 sin``
(HF's ``x * cos + rotate_half(x) * sin``), in fp32, rounded once to the tensor's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels._launch import next_power_of_2
from kvflow.kernels.rotary_ref import heads_view

__all__ = ["rotary_embedding"]


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate ``num_heads`` heads of one token in place; ``cos``/``sin`` are [BLOCK_HALF]."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    first = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + position * stride_cache
    cos = tl.load(row + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, cos, sin,
                  HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` in place and return them.

    Shapes: ``positions`` [tokens] int32/int64; ``q`` [tokens, num_q_heads * head_dim] or
    [tokens, num_q_heads, head_dim], ``k`` likewise with its own head count (each head's
    elements contiguous); ``cos_sin_cache`` [max_position, head_dim] as built by
    :func:`~kvflow.kernels.build_cos_sin_cache` (cos in the first half, sin in the second).
    """
    q_heads, k_heads = heads_view(q, head_dim), heads_view(k, head_dim)
    tokens = positions.shape[0]
    if tokens:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            positions, q_heads, k_heads, cos_sin_cache,
            q_heads.stride(0), q_heads.stride(1), k_heads.stride(0), k_heads.stride(1),
            cos_sin_cache.stride(0),
            q_heads.shape[1], k_heads.shape[1],
            HALF=half, BLOCK_HALF=next_power_of_2(half),
            BLOCK_HQ=next_power_of_2(q_heads.shape[1]), BLOCK_HK=next_power_of_2(k_heads.shape[1]),
            num_warps=4,
        )  # fmt: skip
    return q, k
