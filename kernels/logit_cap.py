"""Logit soft-capping (Gemma 2) in pure torch: ``cap * tanh(x / cap)`` squashes attention
scores (after the scale, before the softmax) into ``(-cap, cap)``; the contract of
:mod:`kvflow.kernels.softcap`'s Triton form, torch only (the CPU path imports it without
Triton)."""

from __future__ import annotations

import torch

__all__ = ["softcap_ref"]


def softcap_ref(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Pure-torch soft-capping (transformers' ``tanh(x / cap) * cap``); None: ``x``."""
    return x if cap is None else torch.tanh(x / cap) * cap
