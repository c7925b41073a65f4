"""Mixtral: Llama's attention, and a mixture of experts in place of every layer's MLP
(softmax over the experts, top-k, weights renormalised to sum to 1); the layers come from
:class:`LlamaForCausalLM`, which puts experts where the config has them."""

from __future__ import annotations

from kvflow.runtime.models.llama import LlamaForCausalLM

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's merged attention projections; ``block_sparse_moe.gate`` is the router and
    ``block_sparse_moe.experts.{e}.w1/w3/w2`` each expert's gate, up and down."""

    renamed_parts = {"block_sparse_moe": "mlp"}
    expert_params = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}
