"""HiCache's L3 as the radix cache sees it: page keys per node, writes of host copies,
prefetches into host pages for waiting requests (all I/O on :class:`StorageIO` threads).

Flow::

    host copy landed (HiRadixCache.poll) -> write(node): keys + host pages -> StorageIO
    request arrives -> start_prefetch(): pages past the device/host match -> host pages
    StorageIO completion -> finish_prefetch(): arrived pages join the tree as host-only
                            nodes; the request is admitted and loads them back as host hits

A prefetch has a time budget (``hicache_prefetch_timeout``); a completion later than the
budget plus :data:`GRACE_S` releases its request anyway, and its host pages are freed
when the worker finally gives them back. The store being down means misses and dropped
writes, counted, never an exception in the scheduler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvflow.runtime.cache.storage import (
    Completion,
    JobKind,
    Outcome,
    StorageIO,
    StoreNamespace,
    page_keys,
)
from kvflow.runtime.mem.host_pool import HostKVPool

if TYPE_CHECKING:
    from kvflow.runtime.core import Req

__all__ = ["GRACE_S", "MIN_PREFETCH_TOKENS", "Prefetch", "StorageTier"]
logger = logging.getLogger(__name__)

GRACE_S = 1.0  # past budget + grace, a request stops waiting for its prefetch
MIN_PREFETCH_TOKENS = 64  # shorter uncached runs are recomputed rather than looked up


@dataclass
class Prefetch:
    """One request's prefetch: its pages would cover ``tokens[start:start + len(keys) * P]``."""

    req: Req
    tokens: list[int]
    start: int
    keys: list[str]
    host_slots: torch.Tensor
    deadline: float
    released: bool = False  # the request went on without it


@dataclass
class _Write:
    node: Any
    pages: int


@dataclass
class StorageTier:
    """Owns the I/O worker and the in-flight jobs; the cache calls it from its one thread."""

    backend: str  # --hicache-storage
    io: StorageIO
    namespace: StoreNamespace
    host: HostKVPool
    budget_s: float
    prefetches: dict[int, Prefetch] = field(default_factory=dict)
    writes: dict[int, _Write] = field(default_factory=dict)

    # -- keys ------------------------------------------------------------------------------
    def keys(self, tokens: list[int], extra_key: str | None, prior: str | None) -> list[str]:
        return page_keys(self.namespace, tokens, prior_key=prior, extra_key=extra_key)

    # -- writes ----------------------------------------------------------------------------
    def write(self, node: Any, keys: list[str]) -> None:
        """Store ``node``'s host copy under ``keys``; the node stays pinned until done."""
        assert node.host_value is not None
        pages = self.host.pages_of(node.host_value).tolist()
        job = self.io.write(keys, [self.host.page(p) for p in pages], tag=None)
        node.pins += 1
        self.writes[job] = _Write(node, len(pages))

    # -- prefetch --------------------------------------------------------------------------
    def start(
        self, req: Req, tokens: list[int], start: int, keys: list[str], host_slots: torch.Tensor
    ) -> None:
        pages = self.host.pages_of(host_slots).tolist()
        job = self.io.prefetch(keys, [self.host.page(p) for p in pages], self.budget_s)
        deadline = time.monotonic() + self.budget_s + GRACE_S
        self.prefetches[job] = Prefetch(req, tokens, start, keys, host_slots, deadline)

    def poll(self) -> tuple[list[tuple[Prefetch, int]], list[Req], list[Any]]:
        """Completions: (finished prefetches with their page count, requests released
        late, nodes whose write ended)."""
        done: list[tuple[Prefetch, int]] = []
        written: list[Any] = []
        for completion in self.io.poll():
            self._complete(completion, done, written)
        now = time.monotonic()
        late = []
        for job in self.prefetches.values():
            if not job.released and now > job.deadline:
                job.released = True
                late.append(job.req)
                logger.warning("storage prefetch for %s overran its budget", job.req.rid)
        return done, late, written

    def _complete(
        self, completion: Completion, done: list[tuple[Prefetch, int]], written: list[Any]
    ) -> None:
        if completion.kind == JobKind.WRITE:
            write = self.writes.pop(completion.job_id, None)
            if write is not None:
                write.node.pins -= 1
                written.append(write.node)
            return
        job = self.prefetches.pop(completion.job_id, None)
        if job is None:
            return
        pages = completion.pages if completion.outcome != Outcome.CANCELLED else 0
        done.append((job, pages))

    def pending(self) -> bool:
        return any(not job.released for job in self.prefetches.values())

    def close(self) -> None:
        """Let writes finish (bounded), stop the worker, then the store."""
        self.io.drain(5.0)
        self.io.close()
        self.io.store.close()
