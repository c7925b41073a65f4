"""What a draft model (STANDALONE) or draft head (EAGLE, EAGLE3) will hold in memory, known
before the target sizes its KV pool.

The draft's pool gets as many token slots as the target's (``max_total_tokens`` of the
draft's runner), so the target sizes its pool with the draft's bytes per token added and,
on CUDA, the draft's weights taken out of the budget first: both pools and both models fit
what ``--mem-fraction-static`` (or ``cpu_kv_cache_gb``) allows, instead of the draft taking
the memory kept back for activations and CUDA graphs. The draft's own decode CUDA graphs
are not counted: they capture into the target's graph memory pool, in that kept-back
memory (:mod:`kvflow.runtime.speculative.draft_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvflow.runtime.config import ModelConfig
from kvflow.runtime.mem import KVPool
from kvflow.runtime.models.paths import resolve_model_path
from kvflow.runtime.models.registry import MODELS

if TYPE_CHECKING:
    from kvflow.runtime.config import EngineConfig

__all__ = ["DraftFootprint", "draft_footprint"]

# algorithms whose drafter runs a model of its own (NGRAM has none)
_WITH_DRAFT_MODEL = ("EAGLE", "EAGLE3", "STANDALONE")


@dataclass(frozen=True)
class DraftFootprint:
    """A draft's weights and KV bytes per token slot, at the target's dtypes."""

    weight_bytes: int
    kv_bytes_per_token: int


def draft_footprint(
    config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype
) -> DraftFootprint | None:
    """The footprint of ``config``'s draft (None without one). The architecture is built on
    the meta device, so its parameters are counted without allocating them (an EAGLE head
    drops the embedding and LM head it shares with the target, and is counted without)."""
    path = config.speculative_draft_model_path
    if (
        config.speculative_algorithm not in _WITH_DRAFT_MODEL
        or not path
        or config.speculative_features_only  # a PD prefill: its decode drafts
    ):
        return None
    draft = ModelConfig.from_path(resolve_model_path(path, config.load_format))
    with torch.device("meta"):
        model = MODELS.get(draft.architecture)(draft, tp=None)
    weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    kv = KVPool.bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim, kv_dtype)
    return DraftFootprint(weights, kv)
