"""The vocabulary's layers: the token embedding and the LM head, split across
tensor-parallel ranks by vocabulary rows.

With ``tp``, the vocabulary is padded up to a multiple of the ranks and each rank holds
``padded // size`` consecutive rows (the padding rows are zeros). The embedding looks up
the ids a rank holds and all-reduces (others contribute zeros); the head computes a
rank's logits and all-gathers them, then drops the padding. Without ``tp`` both are the
plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.runtime.distributed import TPGroup
from kvflow.runtime.layers.linear import LinearBase, ShardId
from kvflow.runtime.layers.quantization import LinearMethod

__all__ = ["ParallelLMHead", "VocabParallelEmbedding", "gather_logits"]


def _rows(vocab_size: int, tp: TPGroup | None) -> tuple[int, int]:
    """This rank's first vocabulary row and its row count (padding included)."""
    if tp is None:
        return 0, vocab_size
    local = -(-vocab_size // tp.size)
    return tp.rank * local, local


def _rank_rows(loaded: torch.Tensor, start: int, local: int) -> torch.Tensor:
    """Rows ``[start, start + local)`` of a whole ``[vocab, ...]`` tensor, zero-padded
    past its end."""
    part = loaded[start : start + local]
    if part.shape[0] == local:
        return part
    pad = loaded.new_zeros((local - part.shape[0], *loaded.shape[1:]))
    return torch.cat([part, pad])


def gather_logits(local: torch.Tensor, tp: TPGroup | None, vocab_size: int) -> torch.Tensor:
    """``[tokens, local rows]`` of every rank -> ``[tokens, vocab_size]``, identical on
    every rank."""
    if tp is None:
        return local
    return tp.all_gather(local, dim=-1)[..., :vocab_size]


class VocabParallelEmbedding(nn.Module):
    """``ids`` ``[tokens]`` -> ``[tokens, hidden_size]``; ``weight`` holds this rank's rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, self.local = _rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.local, hidden_size), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        param.data.copy_(_rank_rows(loaded, self.start, self.local))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.start + self.local)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(LinearBase):
    """``[tokens, hidden]`` -> this rank's logits ``[tokens, rows]``; :func:`gather_logits`
    makes the whole vocabulary of them."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        method: LinearMethod | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        self.start, local = _rows(vocab_size, tp)
        super().__init__(hidden_size, [local], False, method)

    def rank_part(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
    ) -> torch.Tensor:
        return _rank_rows(loaded, self.start, self.output_size)
