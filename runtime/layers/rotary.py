"""Rotary position embedding (NeoX / Hugging Face Llama layout), with llama3 scaling.

The cos/sin table comes from :func:`kvflow.kernels.build_cos_sin_cache` (bit-equal to
transformers' in fp32), the same table the Triton kernel reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvflow.kernels import build_cos_sin_cache, cpu, rotary_embedding, rotary_embedding_ref
from kvflow.runtime.layers.cpu_kernels import cpu_kernels_take

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Returns rotated ``q`` and ``k``.

    ``cos_sin_cache`` is ``[max_position, head_dim]`` float32: cos in the first half of the
    last dimension, sin in the second.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(head_dim, max_position, base, rope_scaling),
            persistent=False,
        )

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
            rotate = rotary_embedding
        elif cpu_kernels_take(q, k):
            rotate = cpu.elementwise.rotary_embedding
        else:
            rotate = rotary_embedding_ref
        return rotate(positions, q, k, table, self.head_dim)
