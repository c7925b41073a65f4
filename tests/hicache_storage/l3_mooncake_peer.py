"""A second Mooncake store client, in its own process.

``python -P l3_mooncake_peer.py MASTER METADATA_URL KEYS_JSON``: connects, then reads each
key's page (``l3_helpers.PAGE_BYTES``) and prints JSON: which keys exist, which arrived,
and which equal ``page_bytes(key)``.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from l3_helpers import PAGE_BYTES, page_bytes

from kvflow.runtime.cache.storage.mooncake import MooncakeStore, MooncakeStoreConfig


def main() -> int:
    master, metadata, keys_json = sys.argv[1:4]
    keys = json.loads(keys_json)
    store = MooncakeStore(
        MooncakeStoreConfig(
            master, metadata, global_segment_size=32 << 20, local_buffer_size=16 << 20
        )
    )
    if not store.wait_connected(60):
        print(json.dumps({"connected": False}))
        return 1
    buffers = [np.zeros(PAGE_BYTES, np.uint8) for _ in keys]
    exists = store.exists(keys)
    found = store.get(keys, buffers)
    equal = [bool(np.array_equal(b, page_bytes(k))) for k, b in zip(keys, buffers, strict=True)]
    print(json.dumps({"connected": True, "exists": exists, "found": found, "equal": equal}))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
