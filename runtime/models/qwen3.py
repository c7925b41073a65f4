"""Qwen3 dense: the Llama layer shape with an RMSNorm over each head of q and k before
rotary, no QKV bias, and ``head_dim`` from the config (not hidden / heads)."""

from __future__ import annotations

from torch import nn

from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.layers import LinearMethod, RotaryEmbedding
from kvflow.runtime.models.blocks import DecoderLayer, QKNormAttention
from kvflow.runtime.models.llama import LlamaForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's merged projections and checkpoint names, plus ``self_attn.q_norm`` and
    ``self_attn.k_norm`` in every layer."""

    def build_layer(
        self,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
    ) -> nn.Module:
        return DecoderLayer(self.config, layer_id, rotary, method, tp, attention=QKNormAttention)
