"""Throughput of the two L3 stores on this machine (not a test; run by hand).

``.venv/bin/python -P tests/hicache_storage/bench_l3_stores.py [pages] [page_kib]``: puts
then gets ``pages`` pages (default 512 x 64 KiB) in one batch from one registered pool, into
a file store under /tmp and a Mooncake store against a loopback master it starts. Two
passes: the second pass's puts find every page present (the stores skip them).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from kvflow.runtime.cache.storage import PageStore, StoreNamespace, page_keys
from kvflow.runtime.cache.storage.file import FileStore, FileStoreConfig
from kvflow.runtime.cache.storage.mooncake import MooncakeStore, MooncakeStoreConfig

sys.path.insert(0, str(Path(__file__).parent))  # -P leaves the script's folder out
from l3_helpers import MooncakeMaster


def measure(name: str, store: PageStore, keys: list[str], pool: torch.Tensor) -> None:
    out = torch.zeros_like(pool)
    store.register(pool)
    store.register(out)
    mib = pool.numel() / 2**20
    for rep in range(2):
        began = time.perf_counter()
        stored = store.put(keys, list(pool))
        put_s = time.perf_counter() - began
        began = time.perf_counter()
        found = store.get(keys, list(out))
        get_s = time.perf_counter() - began
        began = time.perf_counter()
        present = store.exists(keys)
        exists_s = time.perf_counter() - began
        assert all(stored) and all(found) and all(present) and torch.equal(pool, out)
        print(
            f"{name} pass {rep + 1}: put {mib / put_s:.0f} MiB/s "
            f"({put_s * 1e3 / len(keys):.3f} ms/page), get {mib / get_s:.0f} MiB/s "
            f"({get_s * 1e3 / len(keys):.3f} ms/page), exists {exists_s * 1e6 / len(keys):.1f} us/key",
            flush=True,
        )


def main() -> None:
    pages = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    page_bytes = (int(sys.argv[2]) if len(sys.argv) > 2 else 64) * 1024
    namespace = StoreNamespace("bench", "bfloat16", 16, 2, 2, 64)
    keys = page_keys(namespace, list(range(16 * pages)))
    pool = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8)
    scratch = Path(tempfile.mkdtemp(prefix="l3-bench-"))
    measure("file", FileStore(FileStoreConfig(scratch / "store", max_bytes=1 << 34)), keys, pool)
    master = MooncakeMaster(scratch / "master.log")
    store = MooncakeStore(
        MooncakeStoreConfig(
            master.address,
            master.metadata_url,
            global_segment_size=2 * pool.numel() + (64 << 20),
            local_buffer_size=64 << 20,
        )
    )
    try:
        assert store.wait_connected(60)
        measure("mooncake", store, keys, pool)
    finally:
        store.close()
        master.stop()


if __name__ == "__main__":
    main()
