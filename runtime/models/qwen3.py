"""Qwen3 dense: the Llama layer shape with an RMSNorm over each head of q and k before
rotary, no QKV bias, and ``head_dim`` from the config (not hidden / heads)."""

from __future__ import annotations

from kvflow.runtime.models.blocks import QKNormAttention
from kvflow.runtime.models.llama import LlamaForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's merged projections and checkpoint names, plus ``self_attn.q_norm`` and
    ``self_attn.k_norm`` in every layer."""

    attention = QKNormAttention
