"""The contract between the scheduler and a prefix cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from kvflow.runtime.core import Req
    from kvflow.runtime.mem import ReqToTokenPool, TokenToKVPoolAllocator
    from kvflow.runtime.wire.hicache import HiCacheStats

__all__ = ["MatchResult", "PrefixCache"]


class MatchResult(NamedTuple):
    """A cached prefix: its KV slots on the device (int64 ``[prefix_len]``) and the node
    that ends it; with a host tier, the tokens cached on host only right after it."""

    kv_indices: torch.Tensor
    last_node: Any
    host_hit_len: int = 0  # tokens after ``kv_indices`` whose KV is on host (HiCache L2)
    host_last_node: Any = None  # the node that ends them


class PrefixCache(ABC):
    """Indexes KV slots by token ids so requests can reuse each other's prefixes.

    Ownership: a KV slot belongs either to the cache (inserted, shared) or to exactly one
    request (its un-inserted tail). A request holds a lock on the node that ends its
    matched prefix; locked nodes and their ancestors are never evicted.

    Each method that takes a request reads ``req.req_pool_idx``, ``req.kv_len``,
    ``req.prefix_indices`` and ``req.last_node`` and updates the last two.
    """

    def __init__(self, req_to_token: ReqToTokenPool, allocator: TokenToKVPoolAllocator) -> None:
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.page_size = allocator.page_size

    @abstractmethod
    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached, page-aligned prefix of ``token_ids`` in namespace ``extra_key``."""

    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring a match's host part onto the device (a tiered cache); the match extends
        only as far as device memory allowed. The caller locks the result."""
        return match

    def tier_stats(self, hits: Any) -> HiCacheStats | None:
        """Counters of the cache's lower tiers (None: a single-tier cache)."""
        return None

    def start_prefetch(self, req: Req) -> bool:
        """Start reading the request's uncached prefix from a storage tier; True when the
        request must wait for it (its release comes out of :meth:`poll`)."""
        return False

    def poll(self) -> list[Req]:
        """Finish background work (copies, storage I/O); called once per scheduler step.
        Returns the requests whose prefetch ended (they may be admitted now)."""
        return []

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: insert the request's KV so far and re-lock its new prefix."""

    @abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """On finish: insert the request's KV, free duplicates and its tail, unlock, free its row."""

    def release_req(self, req: Req) -> None:
        """On retract/abort: free the request's own KV (not the shared prefix), including
        slots taken for a step that did not complete; unlock, free its row."""
        end = max(req.kv_len, req.kv_reserved_len)
        if end > len(req.prefix_indices):
            self.allocator.free(
                self.req_to_token.read(req.req_pool_idx, end, len(req.prefix_indices))
            )
        self.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.reset_kv_state()

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked cached tokens if possible; return how many."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drop every entry (``/flush_cache``); only valid when no request holds a lock."""
