"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) and a mixture of experts in the
layers ``decoder_sparse_step`` and ``mlp_only_layers`` make sparse (a dense gated MLP in
the others); ``norm_topk_prob`` says whether the top-k weights are renormalised."""

from __future__ import annotations

from kvflow.runtime.models.qwen3 import Qwen3ForCausalLM

__all__ = ["Qwen3MoeForCausalLM"]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """``mlp.gate`` is the router and ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` each
    expert's weights; a dense layer's ``mlp`` is named as in Qwen3."""

    expert_params = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
