"""Budgets that bound one prefill batch: tokens, chunk size, KV memory and batch size."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefillBudget"]

# A running request's remaining output is reserved at this many tokens at most, times
# the scheduler's new-token ratio (its estimate of how much of max_new_tokens gets used).
RESERVE_CLIP = 4096


@dataclass
class PrefillBudget:
    """What is left for the prefill batch being built (mutable while it is built)."""

    input_tokens: int  # max_prefill_tokens left
    chunk_tokens: int | None  # chunked_prefill_size left; None when chunking is off
    kv_tokens: int  # KV slots left after reserving decode growth of running requests
    requests: int  # room under max_running_requests
    page_size: int
    admitted: int = 0

    def plan(self, extend_len: int, reserve: int) -> int:
        """How many of ``extend_len`` new tokens fit now (0 = none; less = chunk it)."""
        if self.requests <= 0:
            return 0
        take = extend_len
        if self.chunk_tokens is not None and take > self.chunk_tokens:
            take = self.chunk_tokens - self.chunk_tokens % self.page_size
        if self.admitted and take > self.input_tokens:
            return 0
        full = take == extend_len
        if self.kv_tokens < take + (reserve if full else 0) + self.page_size:
            return 0
        return max(take, 0)

    def consume(self, take: int, reserve: int, full: bool) -> None:
        self.input_tokens -= take
        if self.chunk_tokens is not None:
            self.chunk_tokens -= take
        self.kv_tokens -= take + (reserve if full else 0) + self.page_size
        self.requests -= 1
        self.admitted += 1
