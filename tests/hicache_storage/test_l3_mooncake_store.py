"""The Mooncake store against a real ``mooncake_master`` on loopback: bit-exact round trips,
misses, corrupt objects, and a second client process that reads the first one's pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from l3_helpers import PAGE_BYTES, page_bytes

from kvflow.runtime.cache.storage import HEADER_BYTES, StorageConfig, StoreNamespace, page_keys
from kvflow.runtime.cache.storage.mooncake import MooncakeStore, MooncakeStoreConfig

NS = StoreNamespace("test-model", "bfloat16", 16, 2, 2, 64)
REGISTERED_POOL = torch.zeros(300, PAGE_BYTES, dtype=torch.uint8)


@pytest.fixture(scope="module")
def store(mooncake_master, tmp_path_factory) -> Iterator[MooncakeStore]:
    config_file = tmp_path_factory.mktemp("mooncake-config") / "mooncake.json"
    # The operator's mooncake.json, with this test's master and small segments.
    config_file.write_text(
        json.dumps(
            {
                "local_hostname": "",
                "metadata_server": mooncake_master.metadata_url,
                "master_server_address": mooncake_master.address,
                "global_segment_size": 64 << 20,
                "local_buffer_size": 16 << 20,
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    config = StorageConfig.from_flags(
        "mooncake", mooncake_master.address, env={"KVFLOW_MOONCAKE_CONFIG": str(config_file)}
    )
    from kvflow.runtime.cache.storage import create_store

    opened = create_store(config)
    assert isinstance(opened, MooncakeStore)
    assert opened.wait_connected(60), "the store client did not connect to the master"
    yield opened
    opened.close()


def test_config_resolution(tmp_path):
    config = MooncakeStoreConfig.resolve("10.0.0.5:50051")
    assert config.metadata_server == "http://10.0.0.5:8080/metadata"
    clashing = tmp_path / "mooncake.json"
    clashing.write_text(
        json.dumps({"master_server_address": "other:50051", "metadata_server": "x"})
    )
    with pytest.raises(ValueError, match="different Mooncake masters"):
        MooncakeStoreConfig.resolve("10.0.0.5:50051", str(clashing))
    assert MooncakeStoreConfig.resolve("", str(clashing)).master_server_address == "other:50051"
    with pytest.raises(ValueError):
        StorageConfig.from_flags("mooncake", "", env={})


def test_round_trip_bit_exact(store):
    keys = page_keys(NS, list(range(16 * 40)))
    pages = [torch.randn(PAGE_BYTES // 2, dtype=torch.bfloat16) for _ in keys]
    assert store.put(keys, pages) == [True] * len(keys)
    assert store.exists([*keys, "absent-key"]) == [True] * len(keys) + [False]
    readback = [torch.empty_like(p) for p in pages]
    assert store.get(keys, readback) == [True] * len(keys)
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(pages, readback, strict=True)
    )
    stats = store.stats()
    assert stats.available and stats.errors == 0 and stats.corrupt_pages == 0


def test_round_trip_inside_a_registered_pool(store):
    """Pages as views into one registered host pool (how the host tier hands them over),
    batches larger than the header arena."""
    pool = REGISTERED_POOL  # registered memory must outlive the store: module-level
    store.register(pool)
    keys = page_keys(NS, [7] * (16 * 300))
    sent = torch.randint(0, 256, (300, PAGE_BYTES), dtype=torch.uint8)
    pool.copy_(sent)
    assert store.put(keys, list(pool)) == [True] * 300
    pool.zero_()
    assert store.get(keys, list(pool)) == [True] * 300
    assert torch.equal(pool, sent)


def test_misses_and_wrong_sizes(store):
    keys = page_keys(NS, list(range(5000, 5000 + 32)))
    out = np.zeros(PAGE_BYTES, np.uint8)
    assert store.get(keys[:1], [out]) == [False]
    assert store.put(keys[:1], [page_bytes(keys[0])]) == [True]
    corrupt_before = store.stats().corrupt_pages
    assert store.get(keys[:1], [np.zeros(PAGE_BYTES // 2, np.uint8)]) == [False]
    assert store.get(keys[:1], [np.zeros(PAGE_BYTES * 2, np.uint8)]) == [False]
    stats = store.stats()
    assert stats.corrupt_pages == corrupt_before + 2
    assert stats.errors == 0 and stats.available  # a size mismatch is no store failure
    assert store.get(keys[:1], [out]) == [True] and np.array_equal(out, page_bytes(keys[0]))


def test_object_with_a_bad_checksum_or_key_is_a_miss(store):
    """Objects written behind the store's back (raw client calls): a flipped payload byte,
    another key's header. Both must be misses."""
    client = store._client
    good_key, bad_crc_key, wrong_key = page_keys(NS, list(range(9000, 9000 + 48)))
    payload = page_bytes(good_key)
    assert store.put([good_key], [payload]) == [True]
    header = np.zeros(HEADER_BYTES, np.uint8)
    body = np.zeros(PAGE_BYTES, np.uint8)
    assert client.get_into(good_key, header.ctypes.data, HEADER_BYTES) == -600  # too small
    whole = np.zeros(HEADER_BYTES + PAGE_BYTES, np.uint8)
    assert client.get_into(good_key, whole.ctypes.data, whole.nbytes) == whole.nbytes
    flipped = whole.copy()
    flipped[HEADER_BYTES + 99] ^= 0x10
    assert client.put(bad_crc_key, flipped.tobytes()) == 0
    assert client.put(wrong_key, whole.tobytes()) == 0  # good_key's header under wrong_key
    before = store.stats().corrupt_pages
    assert store.get([bad_crc_key, wrong_key], [body, body.copy()]) == [False, False]
    assert store.stats().corrupt_pages == before + 2


def test_second_process_reads_the_first_ones_pages(store, mooncake_master):
    keys = page_keys(NS, list(range(20_000, 20_000 + 16 * 12)))
    assert store.put(keys, [page_bytes(key) for key in keys]) == [True] * len(keys)
    peer = Path(__file__).parent / "l3_mooncake_peer.py"
    result = subprocess.run(
        [
            sys.executable,
            "-P",
            str(peer),
            mooncake_master.address,
            mooncake_master.metadata_url,
            json.dumps([*keys, "never-written"]),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["exists"] == [True] * len(keys) + [False]
    assert seen["found"] == [True] * len(keys) + [False]
    assert seen["equal"][: len(keys)] == [True] * len(keys)
