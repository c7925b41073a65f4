"""The router's choice and the experts' computation, apart from the layers that hold the
weights (``moe.py``) so that the experts' methods (``quantization/``) can run it.

On CUDA the experts run as :func:`kvflow.kernels.fused_moe` (pairs sorted by expert, two
grouped GEMMs in Triton; at decode a GEMV per pair instead, no sort; either capturable in a
CUDA graph); on CPU as :func:`fused_experts_ref`
(tokens grouped by expert, one gate-up and down matmul per expert that has any).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvflow.runtime.layers.activation import silu_and_mul

__all__ = ["TopK", "fused_experts", "fused_experts_ref", "select_experts"]


class TopK(NamedTuple):
    """Each token's chosen experts: ``ids`` ``[tokens, top_k]`` (int64) and their float32
    ``weights``, highest first."""

    weights: torch.Tensor
    ids: torch.Tensor


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> TopK:
    """Softmax over all experts (in float32), the ``top_k`` largest; with ``renormalize``
    (Mixtral always, Qwen-MoE by ``norm_topk_prob``) scaled to sum to 1 per token."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopK(weights, ids)


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_and_mul(F.linear(x, w13)), w2)


def fused_experts_ref(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk: TopK
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(hidden[t])``: ``[tokens, hidden]`` -> same.

    The (token, expert) pairs are sorted by expert, each expert with pairs runs once on its
    tokens, and ``index_add_`` sums the weighted rows back in expert order. That needs the
    per-expert counts on the host (a sync), which is why CUDA runs the fused kernel.
    """
    out = torch.zeros_like(hidden)
    num_experts, top_k = w13.shape[0], topk.ids.shape[1]
    flat_ids = topk.ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # pair p is token p // top_k
    flat_weights = topk.weights.flatten()
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        y = _expert_mlp(hidden[tokens], w13[expert], w2[expert])
        out.index_add_(0, tokens, y * flat_weights[pairs, None].to(y.dtype))
    return out


def fused_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk: TopK
) -> torch.Tensor:
    """:func:`fused_experts_ref`'s result with float weights ``w13`` ``[E, 2I, H]`` and
    ``w2`` ``[E, H, I]``: the fused kernel on CUDA (no host sync, so CUDA graphs capture
    it), the grouped loop on CPU."""
    if hidden.is_cuda:
        from kvflow.kernels import fused_moe

        return fused_moe(hidden, w13, w2, topk.weights, topk.ids)
    return fused_experts_ref(hidden, w13, w2, topk)
