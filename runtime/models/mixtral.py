"""Mixtral: Llama's attention, and a mixture of experts in place of every layer's MLP
(softmax over the experts, top-k, weights renormalised to sum to 1)."""

from __future__ import annotations

from torch import nn

from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.layers import LinearMethod, RotaryEmbedding
from kvflow.runtime.models.blocks import DecoderLayer, layer_mlp
from kvflow.runtime.models.llama import LlamaForCausalLM

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's merged attention projections; ``block_sparse_moe.gate`` is the router and
    ``block_sparse_moe.experts.{e}.w1/w3/w2`` each expert's gate, up and down."""

    renamed_parts = {"block_sparse_moe": "mlp"}
    expert_params = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}

    def build_layer(
        self,
        layer_id: int,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        tp: TPGroup | None,
    ) -> nn.Module:
        mlp = layer_mlp(self.config, layer_id, method, tp)
        return DecoderLayer(self.config, layer_id, rotary, method, tp, mlp=mlp)
