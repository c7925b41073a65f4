"""Sparse mixture of experts: a replicated router picks ``top_k`` SwiGLU experts per token.

Every expert's weights are stacked in two parameters, ``w13`` ``[num_experts, 2 *
intermediate, hidden]`` (gate rows, then up rows) and ``w2`` ``[num_experts, hidden,
intermediate]``, filled from a checkpoint's per-expert tensors by
:meth:`ExpertWeights.weight_loader`. With ``tp``, each rank holds its part of every
expert's intermediate width (rows of gate and up, columns of down) and the block
all-reduces its output once, as the dense MLP does; no expert parallelism.

On CUDA the experts run as :func:`kvflow.kernels.fused_moe` (pairs sorted by expert, two
grouped GEMMs in Triton, capturable in a CUDA graph); on CPU as :func:`fused_experts_ref`
(tokens grouped by expert, one gate-up and down matmul per expert that has any).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.runtime.distributed import TPGroup, shard_range
from kvflow.runtime.layers.activation import silu_and_mul
from kvflow.runtime.layers.linear import ReplicatedLinear

__all__ = [
    "ExpertWeights",
    "SparseMoE",
    "TopK",
    "fused_experts_ref",
    "select_experts",
]


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


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: ``weight`` ``[num_experts, sum(output_sizes),
    input_size]``. Shard ``(expert, part)`` is expert ``expert``'s checkpoint tensor for
    rows ``[sum(output_sizes[:part]), ...)``. With ``tp``, ``split_dim`` of each checkpoint
    tensor is divided among the ranks (0: rows, the column-parallel gate and up; 1:
    columns, the row-parallel down)."""

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_sizes: Sequence[int],
        split_dim: int,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.split_dim = tp, split_dim
        size = tp.size if tp else 1
        if split_dim == 0:
            output_sizes = [n // size for n in output_sizes]
        else:
            input_size //= size
        self.output_sizes = tuple(output_sizes)
        self.shard_ids = tuple((e, p) for e in range(num_experts) for p in range(len(output_sizes)))
        weight = torch.empty(num_experts, sum(output_sizes), input_size)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]
    ) -> None:
        """Copy this rank's part of one expert's checkpoint tensor into its rows."""
        expert, part = shard_id
        if self.tp is not None:
            start, end = shard_range(loaded.shape[self.split_dim], self.tp.rank, self.tp.size)
            loaded = loaded.narrow(self.split_dim, start, end - start)
        offset = sum(self.output_sizes[:part])
        target = param.data[expert].narrow(0, offset, self.output_sizes[part])
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert {expert} part {part}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)


class Experts(nn.Module):
    """``w13`` (shards ``(e, 0)`` gate, ``(e, 1)`` up) and ``w2`` (shard ``(e, 0)``)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup | None
    ) -> None:
        super().__init__()
        inter = intermediate_size
        self.w13 = ExpertWeights(num_experts, hidden_size, [inter, inter], 0, tp)
        self.w2 = ExpertWeights(num_experts, inter, [hidden_size], 1, tp)


class SparseMoE(nn.Module):
    """``gate`` (the router, replicated and unquantized) -> :func:`select_experts` -> the
    experts (the fused kernel on CUDA, :func:`fused_experts_ref` on CPU) -> one all-reduce
    under ``tp``: ``[tokens, hidden]`` -> same."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.tp = top_k, renormalize, tp
        self.gate = ReplicatedLinear(hidden_size, num_experts, False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        w13, w2 = self.experts.w13.weight, self.experts.w2.weight
        if hidden.is_cuda:  # the fused Triton kernel: no host sync, so CUDA graphs capture it
            from kvflow.kernels import fused_moe

            out = fused_moe(hidden, w13, w2, topk.weights, topk.ids)
        else:
            out = fused_experts_ref(hidden, w13, w2, topk)
        return out if self.tp is None else self.tp.all_reduce(out)
