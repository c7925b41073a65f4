"""Background storage I/O: the scheduler submits jobs and polls completions, never blocking.

::

    scheduler loop                     reader threads (num_readers)    writer threads
    --------------                     ----------------------------    --------------
    prefetch(keys, bufs, budget) ─┐    get() chunk by chunk, stop at
    lookup(keys, budget)         ─┼──▶ the first missing page or the
    write(keys, bufs)            ─┼─┐  deadline                        exists(), put() the
    poll() ◀── completions ───────┘ └────────────────────────────────▶ absent pages

Ownership: the buffers of a job belong to the worker from submission until its
:class:`Completion` comes out of :meth:`StorageIO.poll` (even after :meth:`cancel` or a
timeout: a store call under way is not interrupted). The caller must keep them alive and
must not reuse them until then; after a prefetch, only the first ``pages`` buffers hold
verified pages.

Budgets: a prefetch's (or lookup's) time budget runs from submission, queueing included.
It is checked before each chunk of ``chunk_pages`` pages, so a job ends at most one store
call after its deadline; the pages that arrived by then are reported (best effort).

Writes are dropped, not queued, past ``max_pending_write_pages`` (a slow store must not
grow host memory held for it): the job completes at once as ``DROPPED``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvflow.runtime.cache.storage.base import PageStore, StoreStats, leading_count
from kvflow.runtime.cache.storage.metrics import IOCounters, IOStats
from kvflow.runtime.cache.storage.page import PageBuffer, byte_view

__all__ = ["Completion", "IOConfig", "JobKind", "Outcome", "StorageIO"]

logger = logging.getLogger(__name__)


class JobKind(str, Enum):
    PREFETCH = "prefetch"
    LOOKUP = "lookup"
    WRITE = "write"


class Outcome(str, Enum):
    """How a job ended. Prefetch/lookup: ``HIT_FULL`` (every page), ``PARTIAL`` (a leading
    run, then a missing page), ``MISS`` (not even the first page), ``TIMEOUT`` (the budget
    ran out; ``pages`` may still be > 0), ``CANCELLED``. Write: ``WRITTEN`` (every page is
    in the store), ``FAILED`` (some are not), ``DROPPED`` (not attempted: queue full or
    closing)."""

    HIT_FULL = "hit_full"
    PARTIAL = "partial"
    MISS = "miss"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    WRITTEN = "written"
    FAILED = "failed"
    DROPPED = "dropped"


@dataclass(frozen=True)
class Completion:
    """The end of a job. ``pages``: prefetch: leading pages now in the buffers (verified);
    lookup: leading pages present in the store; write: pages in the store after the job."""

    job_id: int
    kind: JobKind
    outcome: Outcome
    pages: int
    requested: int
    elapsed_s: float
    tag: object = None


@dataclass(frozen=True)
class IOConfig:
    """Worker threads per direction; pages per store call (the budget's granularity); the
    most write pages queued before writes are dropped; whether writes skip present pages;
    how long :meth:`StorageIO.close` waits for its threads."""

    num_readers: int = 2
    num_writers: int = 1
    chunk_pages: int = 16
    max_pending_write_pages: int = 8192
    skip_existing_writes: bool = True  # ask exists() first and put only absent pages
    close_timeout_s: float = 5.0


@dataclass(frozen=True)
class _Job:
    job_id: int
    kind: JobKind
    keys: Sequence[str]
    buffers: Sequence[PageBuffer]
    submitted: float
    deadline: float
    tag: object


class StorageIO:
    """Runs a :class:`PageStore`'s calls on background threads; see the module docstring."""

    def __init__(self, store: PageStore, config: IOConfig | None = None) -> None:
        self.store = store
        self.config = config or IOConfig()
        self._counters = IOCounters()
        self._ids = itertools.count(1)
        self._reads: queue.Queue[_Job | None] = queue.Queue()
        self._writes: queue.Queue[_Job | None] = queue.Queue()
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._cancelled: set[int] = set()
        self._unfinished = 0  # jobs submitted and not yet completed
        self._pending_write_pages = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(self._reads,), name=f"l3-read-{i}")
            for i in range(self.config.num_readers)
        ] + [
            threading.Thread(target=self._serve, args=(self._writes,), name=f"l3-write-{i}")
            for i in range(self.config.num_writers)
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    # -- submission (scheduler thread; never blocks on the store) ---------------------------

    def prefetch(
        self, keys: Sequence[str], buffers: Sequence[PageBuffer], budget_s: float, tag=None
    ) -> int:
        """Read the leading run of ``keys`` present in the store into ``buffers``."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        return self._submit(JobKind.PREFETCH, keys, buffers, budget_s, tag, self._reads)

    def lookup(self, keys: Sequence[str], budget_s: float, tag=None) -> int:
        """Count the leading run of ``keys`` present in the store (no data moves)."""
        return self._submit(JobKind.LOOKUP, keys, (), budget_s, tag, self._reads)

    def write(self, keys: Sequence[str], buffers: Sequence[PageBuffer], tag=None) -> int:
        """Store ``buffers`` under ``keys`` (write-back from the host copy)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        with self._lock:
            full = self._pending_write_pages + len(keys) > self.config.max_pending_write_pages
            if not full:
                self._pending_write_pages += len(keys)
        if full:
            job_id = next(self._ids)
            self._counters.write_done(Outcome.DROPPED.value)
            self._done.put(
                Completion(job_id, JobKind.WRITE, Outcome.DROPPED, 0, len(keys), 0.0, tag)
            )
            return job_id
        return self._submit(JobKind.WRITE, keys, buffers, float("inf"), tag, self._writes)

    def _submit(self, kind, keys, buffers, budget_s, tag, jobs: queue.Queue) -> int:
        now = time.monotonic()
        job = _Job(next(self._ids), kind, list(keys), list(buffers), now, now + budget_s, tag)
        with self._lock:  # NOTE: enqueued under the lock, so never behind close()'s sentinels
            if self._closed:
                raise RuntimeError("StorageIO is closed")
            self._unfinished += 1
            jobs.put(job)
        return job.job_id

    def cancel(self, job_id: int) -> None:
        """Stop a prefetch/lookup before its next chunk; it still completes (``CANCELLED``)."""
        with self._lock:
            self._cancelled.add(job_id)

    def poll(self) -> list[Completion]:
        """Every completion not returned yet, oldest first; never blocks."""
        completions = []
        while True:
            try:
                completions.append(self._done.get_nowait())
            except queue.Empty:
                return completions

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted job has completed (shutdown, tests); False at timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._unfinished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def stats(self) -> IOStats:
        return self._counters.snapshot()

    def store_stats(self) -> StoreStats:
        return self.store.stats()

    def close(self) -> None:
        """Stop accepting jobs; queued jobs complete as ``CANCELLED``/``DROPPED``; wait for
        the threads up to ``close_timeout_s`` (a thread stuck in a store call is left
        behind as a daemon). Does not close the store."""
        with self._lock:
            self._closed = True
            for jobs, count in (
                (self._reads, self.config.num_readers),
                (self._writes, self.config.num_writers),
            ):
                for _ in range(count):
                    jobs.put(None)
        deadline = time.monotonic() + self.config.close_timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- worker threads ----------------------------------------------------------------------

    def _serve(self, jobs: queue.Queue[_Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                if self._closed:
                    completion = self._complete(job, self._abandoned_outcome(job), 0)
                elif job.kind is JobKind.WRITE:
                    completion = self._run_write(job)
                else:
                    completion = self._run_read(job)
            except Exception:  # a store bug must not kill the thread nor lose the job
                logger.exception("storage I/O: %s job %d failed", job.kind.value, job.job_id)
                self._counters.worker_error()
                failed = Outcome.FAILED if job.kind is JobKind.WRITE else Outcome.MISS
                completion = self._complete(job, failed, 0)
            self._finish(job, completion)

    @staticmethod
    def _abandoned_outcome(job: _Job) -> Outcome:
        return Outcome.DROPPED if job.kind is JobKind.WRITE else Outcome.CANCELLED

    def _complete(self, job: _Job, outcome: Outcome, pages: int) -> Completion:
        elapsed = time.monotonic() - job.submitted
        return Completion(job.job_id, job.kind, outcome, pages, len(job.keys), elapsed, job.tag)

    def _finish(self, job: _Job, completion: Completion) -> None:
        if job.kind is JobKind.WRITE:
            self._counters.write_done(completion.outcome.value)
        elif job.kind is JobKind.PREFETCH:
            self._counters.prefetch_done(completion.outcome.value)
        with self._lock:
            self._cancelled.discard(job.job_id)
            if job.kind is JobKind.WRITE:
                self._pending_write_pages -= len(job.keys)
            self._done.put(completion)
            self._unfinished -= 1
            self._lock.notify_all()

    def _run_read(self, job: _Job) -> Completion:
        pages, step = 0, self.config.chunk_pages
        for start in range(0, len(job.keys), step):
            if job.job_id in self._cancelled or self._closed:
                return self._complete(job, Outcome.CANCELLED, pages)
            if time.monotonic() >= job.deadline:
                return self._complete(job, Outcome.TIMEOUT, pages)
            keys = job.keys[start : start + step]
            began = time.monotonic()
            if job.kind is JobKind.LOOKUP:
                arrived = leading_count(self.store.exists(keys))
            else:
                buffers = job.buffers[start : start + step]
                arrived = leading_count(self.store.get(keys, buffers))
                nbytes = sum(byte_view(buffer).nbytes for buffer in buffers[:arrived])
                self._counters.read(arrived, nbytes, time.monotonic() - began)
            pages += arrived
            if arrived < len(keys):
                return self._complete(job, Outcome.PARTIAL if pages else Outcome.MISS, pages)
        return self._complete(job, Outcome.HIT_FULL, pages)

    def _run_write(self, job: _Job) -> Completion:
        todo = list(range(len(job.keys)))
        if self.config.skip_existing_writes and todo:
            present = self.store.exists(job.keys)
            todo = [i for i in todo if not present[i]]
        stored = len(job.keys) - len(todo)
        step = self.config.chunk_pages
        for start in range(0, len(todo), step):
            if self._closed:
                break
            chosen = todo[start : start + step]
            buffers = [job.buffers[i] for i in chosen]
            began = time.monotonic()
            flags = self.store.put([job.keys[i] for i in chosen], buffers)
            written = [b for b, ok in zip(buffers, flags, strict=True) if ok]
            nbytes = sum(byte_view(buffer).nbytes for buffer in written)
            self._counters.wrote(len(written), nbytes, time.monotonic() - began)
            stored += len(written)
        outcome = Outcome.WRITTEN if stored == len(job.keys) else Outcome.FAILED
        return self._complete(job, outcome, stored)
