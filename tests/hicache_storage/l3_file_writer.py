"""A file-store writer process for the concurrency tests.

``python -P l3_file_writer.py ROOT SEED FIRST COUNT MAX_BYTES ROUNDS``: puts pages
``FIRST .. FIRST+COUNT-1`` (content from ``seed``) ``ROUNDS`` times, reading every page back
after each put; prints a JSON summary. Exits non-zero if a read returned wrong bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from l3_helpers import page_bytes

from kvflow.runtime.cache.storage.file import FileStore, FileStoreConfig


def main() -> int:
    root, seed, first, count, max_bytes, rounds = sys.argv[1:7]
    store = FileStore(FileStoreConfig(Path(root), max_bytes=int(max_bytes), rescan_interval_s=0.2))
    keys = [f"page-{i:06d}" for i in range(int(first), int(first) + int(count))]
    wrong = hits = 0
    out = np.empty_like(page_bytes(keys[0]))
    for _ in range(int(rounds)):
        for key in keys:
            store.put([key], [page_bytes(key, int(seed))])
            if store.get([key], [out])[0]:
                hits += 1
                # Another writer may have stored its own version of a shared key.
                if not any(np.array_equal(out, page_bytes(key, s)) for s in (1, 2)):
                    wrong += 1
    stats = store.stats()
    print(
        json.dumps(
            {
                "hits": hits,
                "wrong": wrong,
                "errors": stats.errors,
                "corrupt": stats.corrupt_pages,
                "evicted": stats.evicted_pages,
            }
        )
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
