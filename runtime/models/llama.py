"""Llama family (Llama, and the Qwen2 and Mistral checkpoints of the same shape): GQA,
RoPE, SwiGLU, RMSNorm, on the shared decoder blocks.

Projections are merged (``qkv_proj``, ``gate_up_proj``) so each layer runs two big
matmuls instead of five; :attr:`LlamaForCausalLM.stacked_params` maps Hugging Face names
onto them.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.layers import LinearMethod, RotaryEmbedding
from kvflow.runtime.models.blocks import MERGED_PROJECTIONS, Attention, DecoderLayer, layer_mlp
from kvflow.runtime.models.causal_lm import CausalLM

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(CausalLM):
    """Pre-norm decoder layers of attention and gated MLP (a mixture of experts in the
    layers a MoE config makes sparse); tied or untied LM head. A family of this shape
    names its ``attention`` class."""

    attention: ClassVar[type[Attention]] = Attention

    stacked_params = MERGED_PROJECTIONS

    def build_layer(
        self,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
    ) -> nn.Module:
        mlp = layer_mlp(self.config, layer_id, method, tp)
        return DecoderLayer(
            self.config, layer_id, rotary, method, tp, attention=self.attention, mlp=mlp
        )
