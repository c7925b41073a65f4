"""The scheduler's view of KV memory: admission, allocation with eviction, accounting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvflow.runtime.cache import PrefixCache
from kvflow.runtime.core import Req
from kvflow.runtime.host_copy import host_to_device
from kvflow.runtime.mem import ReqToTokenPool, TokenToKVPoolAllocator

__all__ = ["DecodeGrowth", "KVManager", "TierHits"]


class DecodeGrowth(NamedTuple):
    """One slot per request taken ahead of need (:meth:`KVManager.try_grow_decode`)."""

    out_cache_loc: torch.Tensor  # [B] on the device; already recorded in the table
    # Per request: the host ``last_loc`` before, and the slot when it opened a new page.
    undo: list[tuple[Req, int | None, int | None]]


@dataclass
class TierHits:
    """Prompt tokens requests found cached at their first admission, by where the KV was."""

    device: int = 0
    host: int = 0
    storage: int = 0


class KVManager:
    """Glue between requests, the two KV pools and the prefix cache."""

    def __init__(
        self, req_to_token: ReqToTokenPool, allocator: TokenToKVPoolAllocator, cache: PrefixCache
    ) -> None:
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self.hit_tokens = TierHits()

    def available_tokens(self) -> int:
        """Tokens that could be allocated now, counting what eviction would free."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def tokens_to_grow(self, req: Req, num_new: int) -> int:
        """KV slots (whole pages) a request needs to grow by ``num_new`` tokens."""
        return self.allocator.pages_needed(req.kv_len, num_new) * self.page_size

    def match(self, req: Req) -> int:
        """Length of the cached prefix the request would reuse, on the device or on the
        host tier (no lock taken, nothing moved)."""
        match = self.cache.match_prefix(req.reusable_ids(), req.extra_key)
        return len(match.kv_indices) + match.host_hit_len

    def admit(self, req: Req) -> bool:
        """Give a waiting request a row and lock its cached prefix (a host-tier part is
        loaded back to the device first). False if no row is free."""
        slot = self.req_to_token.alloc()
        if slot is None:
            return False
        try:
            match = self.cache.match_prefix(req.reusable_ids(), req.extra_key)
            on_device = len(match.kv_indices)
            match = self.cache.load_back(match)
        except BaseException:
            self.req_to_token.free(slot)  # the caller ends the request; its row is back
            raise
        self.cache.inc_lock_ref(match.last_node)
        req.req_pool_idx = slot
        req.prefix_indices, req.last_node = match.kv_indices, match.last_node
        req.kv_len = len(match.kv_indices)
        req.last_loc = None
        self.req_to_token.write(slot, 0, match.kv_indices)
        if not req.admitted:
            req.cached_tokens = req.kv_len
            req.admitted = True
            loaded = req.kv_len - on_device
            from_storage = min(loaded, req.storage_hit_tokens)
            self.hit_tokens.device += on_device
            self.hit_tokens.host += loaded - from_storage
            self.hit_tokens.storage += from_storage
        return True

    def _alloc_host(self, req: Req, num_new: int, evict: bool = True) -> list[int] | None:
        """Slots for the request's next ``num_new`` positions, evicting if needed (and
        allowed)."""
        last_loc = 0
        if req.kv_len > 0:
            if req.last_loc is None:  # a device read (sync); cached for the decode steps after
                req.last_loc = int(self.req_to_token.req_to_token[req.req_pool_idx, req.kv_len - 1])
            last_loc = req.last_loc
        slots = self.allocator.alloc_for_request(req.kv_len, last_loc, num_new)
        if slots is None and evict:
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
        on_device = host_to_device(slots, str(self.req_to_token.req_to_token.device))
        self.req_to_token.write(req.req_pool_idx, req.kv_len, on_device)
        req.kv_reserved_len = req.kv_len + num_new
        return on_device

    def grow_decode(self, reqs: list[Req]) -> torch.Tensor:
        """One slot per request for its next token, recorded with one scatter (decode step).

        The caller has made room (see the scheduler's retraction), so failing is a bug.
        """
        slots = []
        for req in reqs:
            slot = self._alloc_host(req, 1)
            if slot is None:
                raise RuntimeError(f"no KV slot for {req.rid} after making room")
            slots.append(slot[0])
        return self._record_decode(reqs, slots)

    def try_grow_decode(self, reqs: list[Req]) -> DecodeGrowth | None:
        """:meth:`grow_decode` for a step that may never run: takes only free pages (no
        eviction, no device read) and can be undone exactly (:meth:`undo_grow`).

        None, with nothing taken, when that is not possible.
        """
        undo: list[tuple[Req, int | None, int | None]] = []
        slots = []
        for req in reqs:
            last_loc = req.last_loc
            if req.kv_len > 0 and last_loc is None:
                slot = None  # the slot before would have to be read from the device
            else:
                slot = self._alloc_host(req, 1, evict=False)
            if slot is None:
                self.undo_grow(DecodeGrowth(torch.empty(0), undo))
                return None
            undo.append((req, last_loc, slot[0] if req.kv_len % self.page_size == 0 else None))
            slots.append(slot[0])
        return DecodeGrowth(self._record_decode(reqs, slots), undo)

    def undo_grow(self, growth: DecodeGrowth) -> None:
        """Give back what :meth:`try_grow_decode` took; the free-page list ends up as it was.

        The table entries written stay past each request's ``kv_len``, where nothing reads.
        """
        for req, last_loc, new_page_slot in reversed(growth.undo):
            if new_page_slot is not None:
                self.allocator.free(torch.tensor([new_page_slot]))
            req.last_loc = last_loc
            req.kv_reserved_len = req.kv_len

    def _record_decode(self, reqs: list[Req], slots: list[int]) -> torch.Tensor:
        """Write each request's new slot at position ``kv_len`` of its row (one copy and
        one scatter, queued without waiting); returns the slots on the device."""
        table = self.req_to_token.req_to_token
        row_len = table.shape[1]
        flat = [r.req_pool_idx * row_len + r.kv_len for r in reqs]
        for req in reqs:
            req.kv_reserved_len = req.kv_len + 1
        slots_dev, flat_dev = host_to_device([slots, flat], str(table.device))
        table.view(-1).index_copy_(0, flat_dev, slots_dev.to(table.dtype))
        return slots_dev

    def grow_host(self, req: Req, num_new: int) -> list[int] | None:
        """:meth:`grow`, returning the slots as a host list (None: nothing taken)."""
        slots = self._alloc_host(req, num_new)
        if slots is None:
            return None
        on_device = host_to_device(slots, str(self.req_to_token.req_to_token.device))
        self.req_to_token.write(req.req_pool_idx, req.kv_len, on_device)
        req.kv_reserved_len = req.kv_len + num_new
        return slots

    def shrink(self, req: Req, slots: list[int], start: int) -> None:
        """After a step that took ``slots`` for positions ``start:`` and kept only those
        below ``req.kv_len``: give back the pages wholly past ``kv_len`` (the rest of the
        page ``kv_len - 1`` is in stays the request's, for its next tokens)."""
        page = self.page_size
        keep_end = -(-req.kv_len // page) * page  # kv_len rounded up to a page boundary
        dead = slots[max(keep_end - start, 0) :]
        if dead:
            self.allocator.free(torch.tensor(dead, dtype=torch.int64))
        req.last_loc = slots[req.kv_len - 1 - start] if req.kv_len > start else None
        req.kv_reserved_len = req.kv_len

    def is_fully_free(self) -> bool:
        """True when no request holds memory (cached prefixes may remain, all unlocked)."""
        cached = self.cache.total_size()
        return (
            self.allocator.available_size() + cached == self.allocator.size
            and self.cache.evictable_size() == cached
            and self.req_to_token.available_size() == self.req_to_token.size
        )
