"""Rotary position embedding in pure torch (NeoX / HF Llama layout): the contract of
:mod:`kvflow.kernels.rotary`'s Triton kernel, torch only (the CPU path imports it without
Triton).

With ``x1, x2`` the first and second halves of a head and ``cos, sin`` the halves of
``cos_sin_cache[position]``: ``x1' = x1 cos - x2 sin`` and ``x2' = x2 cos + x1 sin``
(HF's ``x * cos + rotate_half(x) * sin``), in fp32, rounded once to the tensor's dtype.
"""

from __future__ import annotations

import torch

__all__ = ["heads_view", "rotary_embedding_ref"]


def heads_view(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[tokens, heads * head_dim] or [tokens, heads, head_dim] -> a 3-D view (no copy)."""
    if x.dim() == 2:
        x = x.view(x.shape[0], -1, head_dim)
    if x.shape[-1] != head_dim or x.stride(-1) != 1:
        raise ValueError(f"expected heads of {head_dim} contiguous elements, got {x.shape}")
    return x


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch rotary embedding; returns new tensors shaped like ``q`` and ``k``."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [tokens, half]
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, head_dim).float()
        x1, x2 = heads.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotated.to(x.dtype).reshape(x.shape)

    return rotate(q), rotate(k)
