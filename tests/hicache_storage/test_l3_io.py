"""The storage I/O worker over a real file store: outcomes, budgets, cancellation, write-back,
back-pressure, counters and the ownership of buffers until a completion is polled.

Slow reads are real: a page path that is a named pipe blocks the reader in ``open`` until
the test writes the page object into the pipe."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from l3_helpers import PAGE_BYTES, page_bytes

from kvflow.runtime.cache.storage import (
    IOConfig,
    JobKind,
    Outcome,
    StorageIO,
    StoreNamespace,
    page_keys,
)
from kvflow.runtime.cache.storage.file import FileStore, FileStoreConfig

NS = StoreNamespace("test-model", "bfloat16", 16, 2, 2, 64)


def wait_for(io: StorageIO, count: int, timeout_s: float = 30.0):
    completions = []
    deadline = time.monotonic() + timeout_s
    while len(completions) < count:
        assert time.monotonic() < deadline, f"got {completions}"
        completions += io.poll()
        time.sleep(0.005)
    return completions


def blocked_page(store: FileStore, key: str) -> Path:
    """Make ``key``'s page a named pipe: reading it blocks until :func:`feed` writes."""
    path = store._path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def feed(path: Path, data: bytes, after_s: float) -> threading.Thread:
    def write() -> None:
        time.sleep(after_s)
        with open(path, "wb") as pipe:
            pipe.write(data)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def stored_object(key: str, tmp: Path) -> bytes:
    """The exact bytes the file store writes for ``key``'s page."""
    scratch = FileStore(FileStoreConfig(tmp, max_bytes=1 << 20))
    assert scratch.put([key], [page_bytes(key)]) == [True]
    return scratch._path(key).read_bytes()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> FileStore:
    return FileStore(FileStoreConfig(tmp_path_factory.mktemp("io-store"), max_bytes=1 << 30))


@pytest.fixture
def io(store):
    worker = StorageIO(store, IOConfig(num_readers=1, chunk_pages=2, close_timeout_s=2.0))
    yield worker
    worker.close()


def test_prefetch_outcomes_and_counters(io, store):
    keys = page_keys(NS, list(range(16 * 8)))
    assert store.put(keys[:5], [page_bytes(k) for k in keys[:5]]) == [True] * 5
    assert io.poll() == []
    buffers = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in keys]
    full = io.prefetch(keys[:5], buffers[:5], budget_s=10.0, tag="full")
    partial = io.prefetch(keys, buffers, budget_s=10.0, tag="partial")
    miss = io.prefetch(keys[6:], buffers[6:], budget_s=10.0)
    lookup = io.lookup(keys, budget_s=10.0)
    done = {c.job_id: c for c in wait_for(io, 4)}
    assert io.poll() == []  # each completion comes out once
    assert (done[full].outcome, done[full].pages, done[full].tag) == (Outcome.HIT_FULL, 5, "full")
    assert (done[partial].outcome, done[partial].pages, done[partial].requested) == (
        Outcome.PARTIAL,
        5,
        8,
    )
    assert (done[miss].outcome, done[miss].pages) == (Outcome.MISS, 0)
    assert (done[lookup].kind, done[lookup].outcome, done[lookup].pages) == (
        JobKind.LOOKUP,
        Outcome.PARTIAL,
        5,
    )
    for key, buffer in zip(keys[:5], buffers[:5], strict=True):
        assert np.array_equal(buffer.numpy(), page_bytes(key))
    stats = io.stats()
    assert stats.read_pages == 10 and stats.read_bytes == 10 * PAGE_BYTES
    assert stats.prefetch_outcomes == {"hit_full": 1, "partial": 1, "miss": 1}
    assert stats.read_latency.count == sum(stats.read_latency.bucket_counts) > 0
    assert stats.read_latency.sum_s > 0


def test_write_back_skips_present_pages_and_drops_when_full(store, tmp_path):
    io = StorageIO(store, IOConfig(max_pending_write_pages=6))
    try:
        keys = page_keys(NS, [3] * (16 * 6))
        assert store.put(keys[:2], [page_bytes(k) for k in keys[:2]]) == [True, True]
        over = io.write(keys + keys[:1], [page_bytes(k) for k in keys + keys[:1]])
        written = io.write(keys, [page_bytes(k) for k in keys], tag="wb")
        done = {c.job_id: c for c in wait_for(io, 2)}
        assert done[over].outcome is Outcome.DROPPED and done[over].pages == 0
        assert (done[written].outcome, done[written].pages, done[written].tag) == (
            Outcome.WRITTEN,
            6,
            "wb",
        )
        stats = io.stats()
        assert stats.write_pages == 4  # two were present already
        assert stats.write_bytes == 4 * PAGE_BYTES
        assert stats.write_outcomes == {"dropped": 1, "written": 1}
        out = np.zeros(PAGE_BYTES, np.uint8)
        assert store.get(keys[5:], [out]) == [True] and np.array_equal(out, page_bytes(keys[5]))
    finally:
        io.close()


def test_budget_expires_mid_run_and_in_the_queue(io, store, tmp_path):
    keys = page_keys(NS, list(range(10_000, 10_000 + 16 * 6)))
    assert store.put(keys[:2], [page_bytes(k) for k in keys[:2]]) == [True, True]
    assert store.put(keys[3:], [page_bytes(k) for k in keys[3:]]) == [True] * 3
    # Page 2 arrives only after the budget, in the chunk of pages 2-3 (chunk_pages=2): the
    # job stops there and reports the 4 pages it holds.
    pipe = blocked_page(store, keys[2])
    fed_from = time.monotonic()
    writer = feed(pipe, stored_object(keys[2], tmp_path), after_s=0.8)
    buffers = [np.zeros(PAGE_BYTES, np.uint8) for _ in keys]
    slow = io.prefetch(keys, buffers, budget_s=0.3)
    head_start = time.monotonic() - fed_from  # the writer's clock ran before the job's
    queued = io.prefetch(keys[3:], [np.zeros(PAGE_BYTES, np.uint8) for _ in range(3)], 0.3)
    time.sleep(0.2)
    began = time.monotonic()
    assert io.poll() == []  # nothing done yet, and poll did not wait
    assert time.monotonic() - began < 0.25  # a wait would last until the writer, 0.6 s on
    done = {c.job_id: c for c in wait_for(io, 2)}
    writer.join()
    assert (done[slow].outcome, done[slow].pages) == (Outcome.TIMEOUT, 4)
    assert done[slow].elapsed_s >= 0.8 - head_start  # it waited for the page, past its budget
    assert all(np.array_equal(b, page_bytes(k)) for k, b in zip(keys[:4], buffers, strict=False))
    # The single reader was busy past the second job's deadline: it never touched the store.
    assert (done[queued].outcome, done[queued].pages) == (Outcome.TIMEOUT, 0)
    assert io.stats().prefetch_outcomes["timeout"] == 2


def test_cancel_and_close_with_a_stuck_reader(store, tmp_path):
    io = StorageIO(store, IOConfig(num_readers=1, chunk_pages=1, close_timeout_s=0.5))
    keys = page_keys(NS, list(range(20_000, 20_000 + 16 * 3)))
    assert store.put(keys[1:], [page_bytes(k) for k in keys[1:]]) == [True, True]
    pipe = blocked_page(store, keys[0])
    stuck = io.prefetch(keys[:1], [np.zeros(PAGE_BYTES, np.uint8)], budget_s=60)
    cancelled = io.prefetch(keys[1:], [np.zeros(PAGE_BYTES, np.uint8)] * 2, budget_s=60)
    io.cancel(cancelled)
    queued = io.prefetch(keys[1:], [np.zeros(PAGE_BYTES, np.uint8)] * 2, budget_s=60)
    time.sleep(0.2)
    began = time.monotonic()
    io.close()  # the reader is stuck in open(): close gives up on it after close_timeout_s
    assert time.monotonic() - began < 2.0
    with pytest.raises(RuntimeError):
        io.prefetch(keys[1:], [np.zeros(PAGE_BYTES, np.uint8)] * 2, budget_s=1)
    assert io.poll() == []
    feed(pipe, b"not a page", after_s=0).join()
    done = {c.job_id: c for c in wait_for(io, 3)}
    assert done[stuck].outcome is Outcome.MISS  # the pipe's bytes are no page
    assert done[cancelled].outcome is Outcome.CANCELLED
    assert done[queued].outcome is Outcome.CANCELLED  # queued when closed
    assert io.drain(1.0)


def test_a_failing_job_does_not_kill_the_worker(io, store):
    keys = page_keys(NS, list(range(30_000, 30_000 + 16)))
    assert store.put(keys, [page_bytes(keys[0])]) == [True]
    not_contiguous = torch.zeros(2, PAGE_BYTES, dtype=torch.uint8).t()
    bad = io.prefetch(keys, [not_contiguous], budget_s=5)
    good_buffer = np.zeros(PAGE_BYTES, np.uint8)
    good = io.prefetch(keys, [good_buffer], budget_s=5)
    done = {c.job_id: c for c in wait_for(io, 2)}
    assert done[bad].outcome is Outcome.MISS
    assert done[good].outcome is Outcome.HIT_FULL
    assert np.array_equal(good_buffer, page_bytes(keys[0]))
    assert io.stats().worker_errors == 1


def test_mismatched_batches_are_refused(io):
    with pytest.raises(ValueError):
        io.prefetch(["a", "b"], [np.zeros(8, np.uint8)], budget_s=1)
    with pytest.raises(ValueError):
        io.write(["a"], [], tag=None)
