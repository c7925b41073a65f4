"""Embeddings (``--is-embedding``): which hidden states a prompt's embedding pools, and the
pooling of one request across its prefill chunks.

SGLang's names (``layers/pooler.py``): ``PoolingType.LAST`` is the decoder default, the
final-norm hidden state of the prompt's last token; ``MEAN`` averages every prompt
token's. A sentence-transformers folder says which in ``modules.json`` and its Pooling
module's ``config.json``. The pooled vector is L2-normalised, as SGLang's ``Pooler`` does.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

import torch

__all__ = ["Pool", "PoolingType", "pooling_of"]

_POOLING_MODULE = "sentence_transformers.models.Pooling"


class PoolingType(enum.Enum):
    LAST = "last"
    MEAN = "mean"


def pooling_of(model_folder: Path) -> PoolingType:
    """The pooling a model folder asks for: its sentence-transformers Pooling module's mode,
    else LAST. Raises ValueError for a mode kvflow does not pool (cls, max, weighted...)."""
    modules = model_folder / "modules.json"
    if not modules.is_file():
        return PoolingType.LAST
    for module in json.loads(modules.read_text()):
        if module.get("type") != _POOLING_MODULE:
            continue
        config_file = model_folder / module.get("path", "") / "config.json"
        if not config_file.is_file():
            return PoolingType.LAST
        modes = {
            k.removeprefix("pooling_mode_")
            for k, on in json.loads(config_file.read_text()).items()
            if k.startswith("pooling_mode_") and on
        }
        if modes == {"lasttoken"}:
            return PoolingType.LAST
        if modes == {"mean_tokens"}:
            return PoolingType.MEAN
        raise ValueError(
            f"{config_file}: pooling {sorted(modes)} is not built; kvflow pools "
            "the last token (lasttoken) or the mean of the tokens (mean_tokens)"
        )
    return PoolingType.LAST


class Pool:
    """One request's pooling, fed the hidden states of its new tokens step by step.

    LAST needs only the prompt's last token, so a cached prefix may stand in for the
    others (:meth:`reuse_limit`); MEAN needs every token's hidden state, so nothing is
    reused and the sum is kept in float32 across chunks.
    """

    def __init__(self, pooling: PoolingType) -> None:
        self.pooling = pooling
        self._sum: torch.Tensor | None = None
        self._count = 0

    def reuse_limit(self, seq_len: int) -> int:
        """How many leading tokens may come from the prefix cache."""
        return seq_len - 1 if self.pooling is PoolingType.LAST else 0

    def add(self, hidden: torch.Tensor) -> None:
        """``hidden``: ``[tokens, hidden_size]`` of the next new tokens, in order."""
        if self.pooling is PoolingType.LAST:
            self._sum = hidden[-1].float()
        else:
            part = hidden.float().sum(0)
            self._sum = part if self._sum is None else self._sum + part
        self._count += hidden.shape[0]

    def result(self) -> list[float]:
        """The L2-normalised embedding of everything added."""
        assert self._sum is not None, "no hidden states were pooled"
        pooled = self._sum / self._count if self.pooling is PoolingType.MEAN else self._sum
        return torch.nn.functional.normalize(pooled, dim=0).tolist()
