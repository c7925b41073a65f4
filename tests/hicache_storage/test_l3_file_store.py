"""The file store: bit-exact round trips, concurrent writer processes, the size bound with LRU
eviction, and corrupt pages served as misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from l3_helpers import PAGE_BYTES, page_bytes

from kvflow.runtime.cache.storage import (
    HEADER_BYTES,
    StorageConfig,
    StoreNamespace,
    create_store,
    page_keys,
)
from kvflow.runtime.cache.storage.file import FileStore, FileStoreConfig

NS = StoreNamespace("test-model", "bfloat16", 16, 2, 2, 64)
OBJECT_BYTES = HEADER_BYTES + PAGE_BYTES


def page_files(root: Path) -> list[Path]:
    return [p for p in (root / "pages").rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> FileStore:
    root = tmp_path_factory.mktemp("file-store")
    opened = create_store(StorageConfig.from_flags("file", str(root), max_bytes=1 << 30))
    assert isinstance(opened, FileStore)
    return opened


def test_round_trip_bit_exact_for_tensors_arrays_and_bytearrays(store):
    keys = page_keys(NS, list(range(16 * 6)))
    pages = [torch.randn(PAGE_BYTES // 2, dtype=torch.bfloat16) for _ in range(2)]
    pages += [torch.randint(-(2**31), 2**31 - 1, (PAGE_BYTES // 4,), dtype=torch.int32)]
    pages += [page_bytes(keys[3]), bytearray(page_bytes(keys[4]).tobytes())]
    pages += [torch.tensor([float("nan"), -0.0, float("inf")] * (PAGE_BYTES // 12) + [0.0])]
    sizes = {len(memoryview(p).cast("B")) if not hasattr(p, "nbytes") else p.nbytes for p in pages}
    assert len(keys) == len(pages)
    assert store.put(keys, pages) == [True] * len(keys)
    assert store.exists(keys) == [True] * len(keys)
    readback = [
        torch.empty_like(p) if torch.is_tensor(p) else np.zeros_like(np.asarray(p)) for p in pages
    ]
    readback[4] = bytearray(len(pages[4]))
    assert store.get(keys, readback) == [True] * len(keys)
    for sent, got in zip(pages, readback, strict=True):
        sent_bytes = (
            sent.view(torch.uint8).numpy()
            if torch.is_tensor(sent)
            else np.frombuffer(sent, np.uint8)
        )
        got_bytes = (
            got.view(torch.uint8).numpy() if torch.is_tensor(got) else np.frombuffer(got, np.uint8)
        )
        assert np.array_equal(sent_bytes, got_bytes)  # bit-exact, NaN payloads and -0.0 included
    assert sizes  # the pages are of several sizes; each object carries its own length
    assert store.stats().corrupt_pages == 0


def test_missing_keys_and_a_present_key_is_kept(store):
    keys = page_keys(NS, list(range(1000, 1000 + 32)))
    assert store.exists(keys) == [False, False]
    assert store.get(keys, [np.zeros(PAGE_BYTES, np.uint8)] * 2) == [False, False]
    first, second = page_bytes(keys[0], seed=1), page_bytes(keys[0], seed=2)
    assert store.put(keys[:1], [first]) == [True]
    assert store.put(keys[:1], [second]) == [True]  # present: the stored object stays
    out = np.zeros(PAGE_BYTES, np.uint8)
    assert store.get(keys[:1], [out]) == [True]
    assert np.array_equal(out, first)


def test_no_temporary_files_left(store):
    assert not [p for p in page_files(store.config.root) if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    "damage",
    ["flip_payload_byte", "truncate", "append", "wrong_key", "garbage", "empty"],
)
def test_corrupt_page_is_a_miss_and_removed(store, damage):
    key, other = page_keys(NS, [damage.__hash__() % 1000 + i for i in range(32)])
    good = page_bytes(key)
    assert store.put([key, other], [good, page_bytes(other)]) == [True, True]
    path = store._path(key)
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload_byte":
        raw[HEADER_BYTES + 1234] ^= 0x01
    elif damage == "truncate":
        raw = raw[: HEADER_BYTES + PAGE_BYTES // 2]
    elif damage == "append":
        raw += b"\x00"
    elif damage == "wrong_key":
        raw = bytearray(store._path(other).read_bytes())  # a whole, valid page of another key
    elif damage == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    before = store.stats().corrupt_pages
    out = np.full(PAGE_BYTES, 0xAB, np.uint8)
    assert store.get([key], [out]) == [False]
    assert store.stats().corrupt_pages == before + 1
    assert not path.exists()  # removed, so a later put can store it again
    assert store.put([key], [good]) == [True]
    assert store.get([key], [out]) == [True] and np.array_equal(out, good)


def test_wrong_buffer_size_is_a_miss(store):
    (key,) = page_keys(NS, list(range(5000, 5016)))
    assert store.put([key], [page_bytes(key)]) == [True]
    assert store.get([key], [np.zeros(PAGE_BYTES // 2, np.uint8)]) == [False]


def test_bad_calls_raise():
    with pytest.raises(ValueError):
        StorageConfig.from_flags("s3", "/tmp")
    with pytest.raises(ValueError):
        StorageConfig.from_flags("file", "")


def test_size_bound_evicts_least_recently_used(tmp_path):
    bound = 20 * OBJECT_BYTES
    store = FileStore(FileStoreConfig(tmp_path, max_bytes=bound, evict_to=0.5))
    keys = [f"lru-{i:03d}" for i in range(40)]
    for index, key in enumerate(keys[:20]):
        assert store.put([key], [page_bytes(key)]) == [True]
        os.utime(store._path(key), (1000.0 + index, 1000.0 + index))  # a clear age order
    out = np.zeros(PAGE_BYTES, np.uint8)
    assert store.get([keys[0]], [out]) == [True]  # read: now the most recently used
    assert store.usage_bytes() == bound
    assert store.put([keys[20]], [page_bytes(keys[20])]) == [True]  # over the bound: evict
    present = store.exists(keys[:21])
    # Down to half the bound: the 11 oldest go (keys 1..11); key 0 was touched by the read.
    assert present[0] and present[20]
    assert present[1:12] == [False] * 11 and present[12:20] == [True] * 8
    assert store.usage_bytes() == 10 * OBJECT_BYTES
    assert sum(p.stat().st_size for p in page_files(tmp_path)) == store.usage_bytes()
    assert store.stats().evicted_pages == 11


def test_size_bound_counts_other_processes_writes(tmp_path):
    bound = 30 * OBJECT_BYTES
    first = FileStore(FileStoreConfig(tmp_path, max_bytes=bound, rescan_interval_s=0.0))
    other = FileStore(FileStoreConfig(tmp_path, max_bytes=bound))
    for i in range(25):
        assert other.put([f"other-{i}"], [page_bytes(f"other-{i}")]) == [True]
    for i in range(10):  # each put rescans (interval 0), so first sees the other's pages
        assert first.put([f"first-{i}"], [page_bytes(f"first-{i}")]) == [True]
    assert sum(p.stat().st_size for p in page_files(tmp_path)) <= bound


def test_stale_temporary_files_are_swept(tmp_path):
    store = FileStore(FileStoreConfig(tmp_path, max_bytes=1 << 20, tmp_max_age_s=60))
    shard = tmp_path / "pages" / "00" / "00"
    shard.mkdir(parents=True)
    stale, fresh = shard / ".tmp-1-stale", shard / ".tmp-1-fresh"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    store._scan_and_evict()
    assert not stale.exists() and fresh.exists()


@pytest.mark.parametrize("max_pages", [10_000, 40])
def test_concurrent_writer_processes(tmp_path, max_pages):
    """Two processes write overlapping key ranges (different bytes for shared keys) and read
    them back at once; with a tight bound both also evict. Every read page is whole."""
    script = Path(__file__).parent / "l3_file_writer.py"
    bound = max_pages * OBJECT_BYTES
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-P",
                str(script),
                str(tmp_path),
                str(seed),
                str(first),
                "120",
                str(bound),
                "3",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed, first in ((1, 0), (2, 60))  # keys 60..119 are written by both
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    for result in results:
        assert result["wrong"] == 0 and result["errors"] == 0
    if max_pages == 10_000:
        assert all(r["hits"] == 360 and r["corrupt"] == 0 for r in results)
        store = FileStore(FileStoreConfig(tmp_path, max_bytes=bound))
        keys = [f"page-{i:06d}" for i in range(180)]
        out = np.zeros(PAGE_BYTES, np.uint8)
        for index, key in enumerate(keys):
            assert store.get([key], [out]) == [True]
            writers = (1,) if index < 60 else (2,) if index >= 120 else (1, 2)
            assert any(np.array_equal(out, page_bytes(key, s)) for s in writers)
    else:
        assert sum(r["evicted"] for r in results) > 0
        # Each process may overshoot by the writes it made since its last scan.
        total = sum(p.stat().st_size for p in page_files(tmp_path))
        print("usage after concurrent eviction", total / OBJECT_BYTES, "pages; bound", max_pages)
        assert total <= bound + 2 * 8 * OBJECT_BYTES
    assert not [p for p in page_files(tmp_path) if p.name.startswith(".tmp-")]
