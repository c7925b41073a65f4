"""One Mooncake participant in its own process, for ``test_mooncake_loopback.py``.

``python -P mooncake_loopback_peer.py ROLE ARGS...``; each role prints one JSON line when
its work is done, then stays alive (its sockets open, for the test to look at) until stdin
closes:

- ``store-writer MASTER METADATA_URL KEYS_JSON``: a ``MooncakeStore`` puts each key's
  ``page_bytes(key)``; prints ``{"put": [...]}``.
- ``store-reader MASTER METADATA_URL KEYS_JSON``: a second ``MooncakeStore`` reads them;
  prints ``{"found": [...], "equal": [...]}``.
- ``te-target NBYTES``: a ``MooncakeTransport`` with a zeroed registered buffer; prints
  ``{"session_id", "addr"}``, then answers each stdin line ``digest`` with the buffer's
  blake2b hex digest.
- ``te-source SESSION_ID ADDR NBYTES``: writes ``pattern(NBYTES)`` there; prints
  ``{"digest"}`` of what it wrote.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from typing import Any

import numpy as np
from l3_helpers import PAGE_BYTES, page_bytes


def pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, size=nbytes, dtype=np.uint8)


def digest(data: bytes | np.ndarray) -> str:
    return hashlib.blake2b(bytes(data), digest_size=16).hexdigest()


def say(payload: dict) -> None:
    print(json.dumps(payload), flush=True)


def open_store(master: str, metadata: str) -> Any:
    from kvflow.runtime.cache.storage.mooncake import MooncakeStore, MooncakeStoreConfig

    store = MooncakeStore(
        MooncakeStoreConfig(
            master, metadata, global_segment_size=32 << 20, local_buffer_size=16 << 20
        )
    )
    if not store.wait_connected(60):
        say({"error": "store did not connect within 60 s"})
        sys.exit(1)
    return store


def main() -> int:
    role, args = sys.argv[1], sys.argv[2:]
    keep: list[object] = []
    if role == "store-writer":
        store = open_store(args[0], args[1])
        keys = json.loads(args[2])
        say({"put": store.put(keys, [page_bytes(key) for key in keys])})
        keep.append(store)
    elif role == "store-reader":
        store = open_store(args[0], args[1])
        keys = json.loads(args[2])
        buffers = [np.zeros(PAGE_BYTES, np.uint8) for _ in keys]
        found = store.get(keys, buffers)
        equal = [bool(np.array_equal(b, page_bytes(k))) for k, b in zip(keys, buffers, strict=True)]
        say({"found": found, "equal": equal})
        keep.append(store)
    elif role == "te-target":
        from kvflow.runtime.disagg.transport.mooncake import MooncakeTransport

        nbytes = int(args[0])
        buffer = ctypes.create_string_buffer(nbytes)
        transport = MooncakeTransport()
        transport.register(ctypes.addressof(buffer), nbytes)
        say({"session_id": transport.session_id, "addr": ctypes.addressof(buffer)})
        for line in sys.stdin:
            if line.strip() == "digest":
                say({"digest": digest(buffer.raw)})
        return 0
    elif role == "te-source":
        from kvflow.runtime.disagg.plan import Write
        from kvflow.runtime.disagg.transport.mooncake import MooncakeTransport

        session_id, addr, nbytes = args[0], int(args[1]), int(args[2])
        data = pattern(nbytes)
        transport = MooncakeTransport()
        transport.register(data.ctypes.data, nbytes)
        transport.write(session_id, [Write(data.ctypes.data, addr, nbytes)])
        say({"digest": digest(data)})
        keep.extend([transport, data])
    else:
        raise SystemExit(f"unknown role {role!r}")
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
