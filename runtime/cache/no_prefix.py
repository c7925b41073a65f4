"""The prefix cache used when the radix cache is disabled: nothing is ever shared."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvflow.runtime.cache.base import MatchResult, PrefixCache

if TYPE_CHECKING:
    from kvflow.runtime.core import Req

__all__ = ["NoPrefixCache"]


class NoPrefixCache(PrefixCache):
    """Every request owns all of its KV; finishing frees it. Chunked prefill still works."""

    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), None)

    def cache_unfinished_req(self, req: Req) -> None:
        pass  # the request keeps its slots in its row; nothing to index

    def cache_finished_req(self, req: Req) -> None:
        self.release_req(req)

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
