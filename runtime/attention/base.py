"""The attention-backend contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvflow.runtime.forward_batch import ForwardBatch
    from kvflow.runtime.mem import KVPool, ReqToTokenPool

__all__ = ["AttentionBackend"]


class AttentionBackend(ABC):
    """Computes paged attention for one layer of one batch.

    Shapes: ``q`` ``[N, num_heads, head_dim]``; ``k``/``v`` ``[N, num_kv_heads, head_dim]``
    for the batch's new tokens; the result is ``[N, num_heads, head_dim]``.
    :meth:`forward` first stores the new ``k``/``v`` at ``fb.out_cache_loc`` in the KV pool,
    then attends over each request's full context (cached prefix + new tokens, causal).
    :meth:`init_forward_metadata` runs once per batch, before the first layer, and may
    precompute anything index-shaped into ``fb.attn_metadata``.

    ``layer_windows[layer_id]`` (:meth:`window`) slides that layer's attention: a query at
    position ``p`` sees only the keys at positions ``(p - window, p]`` (transformers'
    ``q_pos - k_pos < sliding_window``), and KV slots before a query's window are not read.
    None, or a layer past the tuple's end: full causal attention. ``logit_cap`` soft-caps
    every layer's scaled scores before the softmax, ``cap * tanh(s / cap)`` (Gemma 2);
    None: none.

    ``model_dtype`` is the dtype of ``q`` (None: the pool's). The pool may store another
    (``--kv-cache-dtype``): attention then reads every key and value as the pool holds it,
    dequantized (:meth:`KVPool.read`: ``stored * scale`` for FP8), the batch's new tokens
    included, so a token's attention does not depend on whether its context was cached,
    chunked or computed in this step.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_windows: tuple[int | None, ...] = (),
        logit_cap: float | None = None,
        model_dtype: torch.dtype | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_windows = layer_windows
        self.logit_cap = logit_cap
        self.model_dtype = kv_pool.dtype if model_dtype is None else model_dtype

    @property
    def reads_stored_kv(self) -> bool:
        """Whether the pool stores K/V in another dtype than ``q``'s (then the new tokens'
        K/V are read back from the pool, as stored, rather than taken as computed)."""
        return self.kv_pool.dtype != self.model_dtype

    def window(self, layer_id: int) -> int | None:
        """Layer ``layer_id``'s attention window, or None for full attention."""
        return self.layer_windows[layer_id] if layer_id < len(self.layer_windows) else None

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.store(layer_id, fb.out_cache_loc, k, v)
        if fb.is_decode:
            return self.forward_decode(q, k, v, layer_id, fb)
        return self.forward_extend(q, k, v, layer_id, fb)
