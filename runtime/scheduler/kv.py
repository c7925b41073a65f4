"""The scheduler's view of KV memory: admission, allocation with eviction, accounting."""

from __future__ import annotations

import torch

from kvflow.runtime.cache import PrefixCache
from kvflow.runtime.mem import ReqToTokenPool, TokenToKVPoolAllocator
from kvflow.runtime.scheduler.req import Req

__all__ = ["KVManager"]


class KVManager:
    """Glue between requests, the two KV pools and the prefix cache."""

    def __init__(
        self, req_to_token: ReqToTokenPool, allocator: TokenToKVPoolAllocator, cache: PrefixCache
    ) -> None:
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size

    def available_tokens(self) -> int:
        """Tokens that could be allocated now, counting what eviction would free."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def tokens_to_grow(self, req: Req, num_new: int) -> int:
        """KV slots (whole pages) a request needs to grow by ``num_new`` tokens."""
        return self.allocator.pages_needed(req.kv_len, num_new) * self.page_size

    def match(self, req: Req) -> int:
        """Length of the cached prefix the request would reuse (no lock taken)."""
        ids = req.all_token_ids()[:-1]  # at least one token must run to produce logits
        return len(self.cache.match_prefix(ids, req.extra_key).kv_indices)

    def admit(self, req: Req) -> bool:
        """Give a waiting request a row and lock its cached prefix. False if no row is free."""
        slot = self.req_to_token.alloc()
        if slot is None:
            return False
        match = self.cache.match_prefix(req.all_token_ids()[:-1], req.extra_key)
        self.cache.inc_lock_ref(match.last_node)
        req.req_pool_idx = slot
        req.prefix_indices, req.last_node = match.kv_indices, match.last_node
        req.kv_len = len(match.kv_indices)
        req.last_loc = None
        self.req_to_token.write(slot, 0, match.kv_indices)
        if not req.admitted:
            req.cached_tokens = req.kv_len
            req.admitted = True
        return True

    def _alloc_host(self, req: Req, num_new: int) -> list[int] | None:
        """Slots for the request's next ``num_new`` positions, evicting if needed."""
        last_loc = 0
        if req.kv_len > 0:
            if req.last_loc is None:  # a device read (sync); cached for the decode steps after
                req.last_loc = int(self.req_to_token.req_to_token[req.req_pool_idx, req.kv_len - 1])
            last_loc = req.last_loc
        slots = self.allocator.alloc_for_request(req.kv_len, last_loc, num_new)
        if slots is None:
            shortfall = self.tokens_to_grow(req, num_new) - self.allocator.available_size()
            self.cache.evict(shortfall)
            slots = self.allocator.alloc_for_request(req.kv_len, last_loc, num_new)
            if slots is None:
                return None
        req.last_loc = slots[-1]
        return slots

    def grow(self, req: Req, num_new: int) -> torch.Tensor | None:
        """Allocate slots for positions ``kv_len:kv_len+num_new`` and record them in the row.

        Evicts unlocked cache entries when needed; returns None (nothing taken) if even
        that is not enough. ``kv_len`` itself is advanced by the caller after the forward.
        """
        slots = self._alloc_host(req, num_new)
        if slots is None:
            return None
        on_device = torch.tensor(slots, dtype=torch.int64).to(
            self.req_to_token.req_to_token.device, non_blocking=True
        )
        self.req_to_token.write(req.req_pool_idx, req.kv_len, on_device)
        return on_device

    def grow_decode(self, reqs: list[Req]) -> torch.Tensor:
        """One slot per request for its next token, recorded with one scatter (decode step).

        The caller has made room (see the scheduler's retraction), so failing is a bug.
        """
        slots, rows, positions = [], [], []
        for req in reqs:
            slot = self._alloc_host(req, 1)
            if slot is None:
                raise RuntimeError(f"no KV slot for {req.rid} after making room")
            slots.append(slot[0])
            rows.append(req.req_pool_idx)
            positions.append(req.kv_len)
        table = self.req_to_token.req_to_token
        out = torch.tensor(slots, dtype=torch.int64).to(table.device, non_blocking=True)
        index = torch.tensor([rows, positions], dtype=torch.int64).to(
            table.device, non_blocking=True
        )
        table[index[0], index[1]] = out.to(table.dtype)
        return out

    def is_fully_free(self) -> bool:
        """True when no request holds memory (cached prefixes may remain, all unlocked)."""
        cached = self.cache.total_size()
        return (
            self.allocator.available_size() + cached == self.allocator.size
            and self.cache.evictable_size() == cached
            and self.req_to_token.available_size() == self.req_to_token.size
        )
