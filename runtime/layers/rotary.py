"""Rotary position embedding (NeoX / Hugging Face Llama layout): default, linear, llama3
and YaRN scaling.

The cos/sin table of the default, linear and llama3 types comes from
:func:`kvflow.kernels.build_cos_sin_cache` (bit-equal to transformers' in fp32); YaRN's is
built here, formula for formula as transformers' ``_compute_yarn_parameters``, with its
attention factor folded into the table. Every kernel reads the same table.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvflow import kernels
from kvflow.kernels import build_cos_sin_cache, cpu, rotary_embedding_ref
from kvflow.runtime.layers.cpu_kernels import cpu_kernels_take

__all__ = ["RotaryEmbedding", "yarn_cos_sin_cache"]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, original_len: int) -> float:
    """The dimension whose wavelength turns ``rotations`` times over ``original_len``."""
    return (dim * math.log(original_len / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_cos_sin_cache(
    head_dim: int, max_position: int, base: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (Qwen2.5 long context): dimensions that turn fast over the original context
    keep their frequency, slow ones are divided by ``factor``, a linear ramp between; cos
    and sin are scaled by the attention factor (``0.1 ln(factor) + 1`` unless given).
    ``[max_position, head_dim]`` float32, as :func:`build_cos_sin_cache`."""
    original_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, head_dim, base, original_len)
    high = _yarn_correction_dim(beta_slow, head_dim, base, original_len)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp

    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    keep = 1 - ramp  # 1: the dimension keeps its frequency (extrapolation)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


class RotaryEmbedding(nn.Module):
    """Returns rotated ``q`` and ``k``.

    ``cos_sin_cache`` is ``[max_position, head_dim]`` float32: cos in the first half of the
    last dimension, sin in the second. ``rope_scaling`` of an unsupported type raises
    ``ValueError`` (``kvflow.runtime.models.check_supported`` refuses it before start-up).
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position
        self.base, self.rope_scaling = base, rope_scaling
        # NOTE: on the meta device (the loader's construction) only the shape: computing the
        # table there runs torch's reference ops, whose first use imports torch._dynamo
        # (4 s of a server's start-up); the loader then builds the real table.
        on_meta = torch.get_default_device().type == "meta"
        cache = torch.empty(max_position, head_dim) if on_meta else self.table()
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def table(self) -> torch.Tensor:
        """A fresh ``cos_sin_cache`` on the current default device (the loader rebuilds it
        after constructing the model on the meta device)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "yarn":
            return yarn_cos_sin_cache(self.head_dim, self.max_position, self.base, scaling)
        return build_cos_sin_cache(self.head_dim, self.max_position, self.base, self.rope_scaling)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[tokens, heads, head_dim]``, ``k`` ``[tokens, kv_heads, head_dim]``.

        CUDA rotates in place with the Triton kernel, CPU with the native C kernel where it
        builds; elsewhere the kernel's reference (float32, equal to transformers' rotation
        for float32 activations).
        """
        table: torch.Tensor = self.cos_sin_cache  # type: ignore[assignment]
        if q.is_cuda:
            rotate = kernels.rotary_embedding  # Triton: imported on CUDA only
        elif cpu_kernels_take(q, k):
            rotate = cpu.elementwise.rotary_embedding
        else:
            rotate = rotary_embedding_ref
        return rotate(positions, q, k, table, self.head_dim)
