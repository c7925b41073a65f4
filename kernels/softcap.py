"""Logit soft-capping (Gemma 2): ``cap * tanh(x / cap)`` squashes attention scores (after
the scale, before the softmax) into ``(-cap, cap)``.

The Triton form is written through ``exp`` of a non-positive number, so it neither
overflows nor needs libdevice (it runs under the interpreter too); it matches
``torch.tanh`` to about 1e-7 relative to ``cap``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["softcap"]


@triton.jit
def softcap(x, cap):
    """``cap * tanh(x / cap)`` elementwise, float32; ``x`` must be finite (cap before
    masking with -inf)."""
    t = tl.exp(-2.0 * tl.abs(x) / cap)
    magnitude = cap * (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -magnitude, magnitude)
