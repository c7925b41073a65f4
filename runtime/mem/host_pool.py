"""The host-memory KV tier (HiCache L2): KV pages in host RAM, laid out page first.

Layout (``P`` = page size, same as the device pool's; page 0 is padding, as there)::

    data[page, layer, k_or_v, 0:P, kv_heads, head_dim]

so one page of every layer's K and V is one contiguous block of :attr:`page_bytes`
bytes: the unit the shared storage tier (L3) reads and writes without another copy.
Host slots are numbered like device slots (``page * P + offset``) and handed out by the
same paged allocator, so a radix node's host copy is a slot tensor like its device one.
"""

from __future__ import annotations

import torch

from kvflow.runtime.mem.allocator import TokenToKVPoolAllocator
from kvflow.runtime.mem.kv_pool import KVPool

__all__ = ["HostKVPool"]


class HostKVPool:
    """``num_pages`` host pages mirroring a device :class:`KVPool`'s page layout.

    Pinned memory when the device pool is on CUDA (asynchronous copies need it).
    """

    def __init__(self, device_pool: KVPool, page_size: int, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the host KV pool needs at least one page")
        k0 = device_pool.k_buffer[0]
        self.num_layers = len(device_pool.k_buffer)
        self.page_size = page_size
        self.num_kv_heads, self.head_dim = k0.shape[1], k0.shape[2]
        self.dtype = k0.dtype
        shape = (num_pages + 1, self.num_layers, 2, page_size, self.num_kv_heads, self.head_dim)
        self.data = torch.zeros(shape, dtype=self.dtype, pin_memory=k0.is_cuda)
        self.allocator = TokenToKVPoolAllocator(num_pages, page_size, "cpu")

    @classmethod
    def sized(cls, device_pool: KVPool, page_size: int, gib: float) -> HostKVPool:
        """A pool of ``gib`` GiB (whole pages; at least one)."""
        k0 = device_pool.k_buffer[0]
        per_token = KVPool.bytes_per_token(
            len(device_pool.k_buffer), k0.shape[1], k0.shape[2], k0.dtype
        )
        return cls(device_pool, page_size, max(1, int(gib * 2**30) // (per_token * page_size)))

    @property
    def page_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    @property
    def size(self) -> int:
        """Usable host slots (tokens)."""
        return self.allocator.size

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The page ids of page-aligned ``slots`` (whole pages, in order)."""
        return slots.view(-1, self.page_size)[:, 0] // self.page_size

    def page(self, page_id: int) -> torch.Tensor:
        """One page's block (a view): what L3 stores under the page's key."""
        return self.data[page_id]
