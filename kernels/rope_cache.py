"""Rotary-embedding cos/sin tables, built in pure torch the way Hugging Face builds them.

Runs on CPU and GPU alike. ``inv_freq`` follows ``transformers``' default RoPE, linear
scaling and Llama 3.1 (``rope_type == "llama3"``) scaling formula for formula, so a table
from here equals ``LlamaRotaryEmbedding``'s cos/sin bit for bit in fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["build_cos_sin_cache", "rope_inv_freq"]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: low frequencies divided by ``factor``, high ones
    kept, the band between them interpolated."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32, CPU) for ``rope_scaling`` of type
    ``None``/``"default"``, ``"linear"`` or ``"llama3"`` (key ``rope_type`` or legacy
    ``type``); other types raise ``ValueError``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Table [max_position, head_dim]: row ``p`` is ``cat(cos(p * inv_freq), sin(p *
    inv_freq))``, each half head_dim // 2 wide (NeoX / HF rotate_half layout), on CPU; move
    it with ``.to(device)``. Computed in fp32, then cast to ``dtype``."""
    inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
