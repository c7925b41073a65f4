"""Rotary position embedding (NeoX / Hugging Face Llama layout), with llama3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "rope_inv_freq"]


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), as transformers computes them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])  # type: ignore[index]
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary embedding: returns rotated ``q`` and ``k``.

    ``cos_sin_cache`` is ``[max_position, head_dim]`` float32: cos in the first half of the
    last dimension, sin in the second (the layout the Triton kernel reads).
    """

    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[tokens, heads, head_dim]``, ``k`` ``[tokens, kv_heads, head_dim]``."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # transformers casts cos/sin to the activations' dtype before rotating; so do we.
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
