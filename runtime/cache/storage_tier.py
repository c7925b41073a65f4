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

Under tensor parallelism every rank stores and fetches its own KV heads' share of each
page (its rank is in the key namespace), and its transfers end at their own times: a
transfer counts as ended only once it has on every rank, a prefetch brings the pages the
rank with the fewest got, and the budget runs on the group's clock (the ``lockstep``), so
the tree and the waiting queue change alike everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvflow.runtime.cache.storage import (
    JobKind,
    Outcome,
    StorageIO,
    StoreNamespace,
    page_keys,
)
from kvflow.runtime.distributed import Lockstep
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
    lockstep: Lockstep = field(default_factory=Lockstep)
    prefetches: dict[int, Prefetch] = field(default_factory=dict)  # in start order
    writes: dict[int, _Write] = field(default_factory=dict)  # in start order
    _fetched: dict[int, int] = field(default_factory=dict)  # job -> pages, ended here
    _written: set[int] = field(default_factory=set)  # writes ended here

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
        deadline = self.lockstep.now() + self.budget_s + GRACE_S
        self.prefetches[job] = Prefetch(req, tokens, start, keys, host_slots, deadline)

    def poll(self) -> tuple[list[tuple[Prefetch, int]], list[Req], list[Any]]:
        """Completions every rank has seen: (finished prefetches with the page count every
        rank has, requests released late, nodes whose write ended)."""
        for completion in self.io.poll():
            if completion.kind == JobKind.WRITE:
                self._written.add(completion.job_id)
            elif completion.job_id in self.prefetches:
                cancelled = completion.outcome == Outcome.CANCELLED
                self._fetched[completion.job_id] = 0 if cancelled else completion.pages
        written = []
        for job in self._agreed(list(self.writes), lambda j: j in self._written):
            self._written.discard(job)
            write = self.writes.pop(job)
            write.node.pins -= 1
            written.append(write.node)
        jobs = self._agreed(list(self.prefetches), lambda j: j in self._fetched)
        pages = self.lockstep.all_min([self._fetched.pop(j) for j in jobs])
        done = [(self.prefetches.pop(j), n) for j, n in zip(jobs, pages, strict=True)]
        now = self.lockstep.now()
        late = []
        for prefetch in self.prefetches.values():
            if not prefetch.released and now > prefetch.deadline:
                prefetch.released = True
                late.append(prefetch.req)
                logger.warning("storage prefetch for %s overran its budget", prefetch.req.rid)
        return done, late, written

    def _agreed(self, jobs: list[int], ended_here: Any) -> list[int]:
        """The ``jobs`` (in start order, the same on every rank) that ended on every rank."""
        ended = self.lockstep.all_true([bool(ended_here(job)) for job in jobs])
        return [job for job, done in zip(jobs, ended, strict=True) if done]

    def pending(self) -> bool:
        return any(not job.released for job in self.prefetches.values())

    def close(self) -> None:
        """Let writes finish (bounded), stop the worker, then the store."""
        self.io.drain(5.0)
        self.io.close()
        self.io.store.close()
