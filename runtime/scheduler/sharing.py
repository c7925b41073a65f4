"""In-batch prefix sharing: hold back a waiting request that the batch is about to serve.

When requests with a common prefix arrive together, nothing of it is cached yet; admitting
them all would compute the prefix once per request. Instead the first one is admitted and
the others wait one step, after which the radix cache holds the prefix for them (the
scheduler caches a prompt as soon as its prefill, or a chunk of it, completes). The same
holds for the siblings of a request being prefilled in chunks. SGLang applies the same
rule (its in-batch prefix-caching check), with the same 32-token thresholds.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.runtime.core import Req

__all__ = ["MIN_SHARED_GAIN", "BatchPrefixes", "common_prefix_len"]

# A waiting request is held back when the batch will cache at least this many more of its
# prompt tokens than are cached now. Prompts are grouped by this many leading tokens.
MIN_SHARED_GAIN = 32
_BLOCK = 256


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (block compares in C)."""
    n = min(len(a), len(b))
    start = 0
    while start < n and a[start : start + _BLOCK] == b[start : start + _BLOCK]:
        start += _BLOCK
    end = min(start + _BLOCK, n)
    while start < end and a[start] == b[start]:
        start += 1
    return min(start, n)


class BatchPrefixes:
    """The prompts admitted into the batch being planned, grouped by their first tokens."""

    def __init__(self) -> None:
        self._by_head: dict[tuple, list[Sequence[int]]] = {}

    @staticmethod
    def _head(req: Req) -> tuple:
        return (req.extra_key, *req.origin_input_ids[:MIN_SHARED_GAIN])

    def add(self, req: Req) -> None:
        if len(req.origin_input_ids) >= MIN_SHARED_GAIN:
            self._by_head.setdefault(self._head(req), []).append(req.origin_input_ids)

    def gain(self, req: Req, cached: int) -> int:
        """Prompt tokens of ``req`` the batch will have cached, beyond the ``cached`` ones."""
        if len(req.origin_input_ids) < MIN_SHARED_GAIN:
            return 0
        others = self._by_head.get(self._head(req), ())
        shared = max((common_prefix_len(req.origin_input_ids, p) for p in others), default=0)
        return max(0, shared - cached)

    def should_wait(self, req: Req, cached: int) -> bool:
        return self.gain(req, cached) >= MIN_SHARED_GAIN
