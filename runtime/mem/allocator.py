"""Second level of KV memory: a paged allocator of KV slots.

Slot layout (``page_size`` P, ``num_pages`` N)::

    slot:  0 .. P-1 | P .. 2P-1 | ... | N*P .. (N+1)*P-1
    page:  0 (pad)  | 1         | ... | N

Page 0 is never handed out: padded tokens (CUDA-graph batches) write their KV there.
A request owns whole pages; its tokens fill a page before the next page is taken, so the
slot of position ``p`` is ``page * P + p % P``.
"""

from __future__ import annotations

import torch

__all__ = ["TokenToKVPoolAllocator"]


class TokenToKVPoolAllocator:
    """Hands out KV slots in pages. Not thread-safe: the scheduler is its only user.

    Allocations come back as Python lists (the scheduler batches them into one tensor per
    step); :meth:`free` takes a tensor of slots on any device.
    """

    def __init__(self, num_pages: int, page_size: int, device: str) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self._free_pages: list[int] = list(range(num_pages, 0, -1))
        self._is_free = [False] + [True] * num_pages  # double-free guard, index = page

    @property
    def size(self) -> int:
        """Usable KV slots (padding page excluded)."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        """Free KV slots, in tokens."""
        return len(self._free_pages) * self.page_size

    def pages_needed(self, cur_len: int, num_new: int) -> int:
        """Pages a request holding ``cur_len`` tokens needs to grow by ``num_new`` tokens."""
        page = self.page_size
        return (cur_len + num_new + page - 1) // page - (cur_len + page - 1) // page

    def _take_pages(self, count: int) -> list[int] | None:
        if count > len(self._free_pages):
            return None
        # The free list's tail, reversed: a fresh pool hands out ascending pages, so a
        # request's slots run forward through memory (hardware prefetchers follow that).
        pages = self._free_pages[len(self._free_pages) - count :][::-1]
        del self._free_pages[len(self._free_pages) - count :]
        for page in pages:
            self._is_free[page] = False
        return pages

    def alloc_for_request(self, cur_len: int, last_loc: int, num_new: int) -> list[int] | None:
        """Slots for positions ``cur_len:cur_len+num_new`` of a request.

        ``last_loc`` is the slot of position ``cur_len - 1`` (ignored when ``cur_len`` is
        page aligned). Returns None, taking nothing, when too few pages are free.
        """
        page = self.page_size
        in_page = min((page - cur_len % page) % page, num_new)
        pages = self._take_pages(self.pages_needed(cur_len, num_new))
        if pages is None:
            return None
        slots = list(range(last_loc + 1, last_loc + 1 + in_page))
        for page_id in pages:
            slots.extend(range(page_id * page, (page_id + 1) * page))
        return slots[:num_new]

    def free(self, slots: torch.Tensor) -> None:
        """Give back the pages that hold ``slots``; the caller guarantees they are all dead."""
        if slots.numel() == 0:
            return
        pages = torch.unique(slots // self.page_size).tolist()
        for page in pages:
            if page == 0 or self._is_free[page]:
                raise RuntimeError(f"KV page {page} freed twice or never allocated")
            self._is_free[page] = True
        # NOTE: descending, as the initial free list: _take_pages reverses the tail, so pages
        # freed together come back ascending and a request reusing them gets consecutive
        # slots (a PD decode's claimed slots then coalesce into one KV write per buffer).
        self._free_pages.extend(reversed(pages))
