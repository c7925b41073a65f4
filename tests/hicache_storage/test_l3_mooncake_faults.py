"""The Mooncake store when its master is away: at start (it connects once the master is up)
and mid-run (killed: calls return misses and dropped writes at once or within Mooncake's own
timeouts, errors are counted, nothing raises; restarted: the store serves again)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from l3_helpers import PAGE_BYTES, MooncakeMaster, free_port, mooncake_installed, page_bytes

from kvflow.runtime.cache.storage import IOConfig, Outcome, StorageIO, StoreNamespace, page_keys
from kvflow.runtime.cache.storage.mooncake import MooncakeStore, MooncakeStoreConfig

pytestmark = pytest.mark.skipif(not mooncake_installed(), reason="Mooncake is not installed")

NS = StoreNamespace("test-model", "bfloat16", 16, 2, 2, 64)
RETRY_S = 1.0
HOST_POOL = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8)  # registered: lives as long as stores


def store_for(rpc_port: int, metadata_port: int) -> MooncakeStore:
    return MooncakeStore(
        MooncakeStoreConfig(
            f"127.0.0.1:{rpc_port}",
            f"http://127.0.0.1:{metadata_port}/metadata",
            global_segment_size=32 << 20,
            local_buffer_size=16 << 20,
            retry_interval_s=RETRY_S,
        )
    )


def settle(io: StorageIO, timeout_s: float = 30.0):
    assert io.drain(timeout_s), "storage jobs did not complete in bounded time"
    return io.poll()


def test_master_unreachable_at_start_then_up(tmp_path):
    rpc_port, metadata_port = free_port(), free_port()
    store = store_for(rpc_port, metadata_port)
    try:
        keys = page_keys(NS, list(range(16 * 2)))
        buffers = [page_bytes(k) for k in keys]
        began = time.monotonic()
        assert store.exists(keys) == [False, False]
        assert store.get(keys, [np.zeros(PAGE_BYTES, np.uint8)] * 2) == [False, False]
        assert store.put(keys, buffers) == [False, False]
        assert time.monotonic() - began < 0.5  # answered at once, not after setup's retries
        stats = store.stats()
        assert not stats.available and stats.skipped_calls == 3
        time.sleep(2.5 * RETRY_S)
        assert store.stats().errors >= 1  # the failed connection attempts
        # The host pool is registered before the client exists (as the cache factory does):
        # the store registers it once connected.
        store.register(HOST_POOL)
        master = MooncakeMaster(tmp_path / "master.log", rpc_port, metadata_port)
        try:
            assert store.wait_connected(30)
            HOST_POOL[:2] = torch.from_numpy(np.stack(buffers))
            assert store.put(keys, list(HOST_POOL[:2])) == [True, True]
            assert store.get(keys, list(HOST_POOL[2:4])) == [True, True]
            assert all(
                np.array_equal(a.numpy(), b) for a, b in zip(HOST_POOL[2:4], buffers, strict=True)
            )
        finally:
            store.close()
            master.stop()
    finally:
        store.close()


def test_master_killed_mid_run_then_restarted(tmp_path):
    master = MooncakeMaster(tmp_path / "master.log")
    store = store_for(master.rpc_port, master.metadata_port)
    io = StorageIO(store, IOConfig(num_readers=2, chunk_pages=4))
    try:
        assert store.wait_connected(60)
        keys = page_keys(NS, list(range(16 * 8)))
        pages = [page_bytes(k) for k in keys]
        io.write(keys, pages)
        (written,) = settle(io)
        assert written.outcome is Outcome.WRITTEN
        buffers = [np.zeros(PAGE_BYTES, np.uint8) for _ in keys]
        io.prefetch(keys, buffers, budget_s=10)
        (hit,) = settle(io)
        assert (hit.outcome, hit.pages) == (Outcome.HIT_FULL, 8)

        master.kill()
        began = time.monotonic()
        outcomes = []
        for round_index in range(3):  # inside and after the down window
            io.prefetch(keys, buffers, budget_s=2)
            io.lookup(keys, budget_s=2)
            extra = page_keys(NS, [round_index + 1] * (16 * 4))
            io.write(extra, [page_bytes(k) for k in extra])
            outcomes += settle(io)
            assert store.exists(keys[:1]) == [False]
            time.sleep(0.6 * RETRY_S)
        elapsed = time.monotonic() - began
        assert elapsed < 45, f"calls against a dead master took {elapsed:.1f} s"
        by_kind: dict[str, set[Outcome]] = {}
        for completion in outcomes:
            by_kind.setdefault(completion.kind.value, set()).add(completion.outcome)
        assert by_kind["prefetch"] <= {Outcome.MISS, Outcome.TIMEOUT}
        assert by_kind["lookup"] <= {Outcome.MISS, Outcome.TIMEOUT}
        assert by_kind["write"] == {Outcome.FAILED}
        assert all(c.pages == 0 for c in outcomes)
        stats = store.stats()
        print(f"dead master: 3 rounds in {elapsed:.2f} s; {stats}")
        assert stats.errors >= 1 and stats.skipped_calls >= 1
        assert io.stats().worker_errors == 0  # nothing raised out of the store

        master.start()  # same ports; the master's index starts empty
        deadline = time.monotonic() + 60
        fresh = page_keys(NS, [42] * (16 * 2))
        while True:
            io.write(fresh, [page_bytes(k) for k in fresh])
            (done,) = settle(io)
            if done.outcome is Outcome.WRITTEN:
                break
            assert time.monotonic() < deadline, "the store did not serve again after restart"
            time.sleep(RETRY_S)
        out = [np.zeros(PAGE_BYTES, np.uint8) for _ in fresh]
        assert store.get(fresh, out) == [True, True]
        assert all(np.array_equal(o, page_bytes(k)) for o, k in zip(out, fresh, strict=True))
        assert store.stats().available
    finally:
        io.close()
        began = time.monotonic()
        store.close()
        assert time.monotonic() - began < 15
        master.stop()
