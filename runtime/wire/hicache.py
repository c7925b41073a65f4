"""HiCache's names and its counters as the scheduler publishes them (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HICACHE_WRITE_POLICIES", "HiCacheStats"]

HICACHE_WRITE_POLICIES = ("write_through", "write_back")


@dataclass(frozen=True)
class HiCacheStats:
    """Cumulative since start, except the pool sizes (a snapshot)."""

    host_total_tokens: int = 0
    host_used_tokens: int = 0
    device_hit_tokens: int = 0  # prompt tokens found on the device at admission
    host_hit_tokens: int = 0  # loaded back from the host tier
    storage_hit_tokens: int = 0  # prefetched from the storage tier
    backed_up_tokens: int = 0  # device -> host copies
    dropped_tokens: int = 0  # device evictions with no room on host
    storage: str = "none"
    storage_read_bytes: int = 0
    storage_write_bytes: int = 0
    storage_read_seconds: float = 0.0
    storage_write_seconds: float = 0.0
    storage_reads: int = 0
    storage_writes: int = 0
    storage_errors: int = 0
    # prefetch outcomes: every page wanted arrived / some / none / the budget ran out first
    prefetch_full: int = 0
    prefetch_partial: int = 0
    prefetch_miss: int = 0
    prefetch_timeout: int = 0
