"""The ``mooncake`` store: ``MooncakeDistributedStore`` against a ``mooncake_master``.

Transfers are zero-copy from the Python side: each page object is put from, and read into,
two memory ranges (a 128-byte header slot and the caller's page buffer) with
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``, and
``batch_is_exist`` answers :meth:`exists`. Header slots live in a per-thread arena
registered with ``register_buffer``; :meth:`register` registers the caller's host pool the
same way. (With ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1 over TCP, addresses
outside registered memory were also read and written correctly in our tests.)

Where the pages live: in the segments the store's clients lend (``global_segment_size``
each); the master only holds the index. A page put by an instance stays readable by others
while that instance lives. If the master restarts, its index is lost (the pages become
misses) and clients reconnect on their own.

Failures never raise (see :class:`PageStore`):

- Start-up: ``setup`` holds the GIL for as long as it runs (measured: ~1 s against a live
  master, ~90 s of internal retries against a dead one, stalling every Python thread). So
  it runs on a background thread, and only once the master's RPC and metadata ports accept
  a TCP connection (probed from Python, without the GIL held); it is retried every
  ``retry_interval_s``. Until it succeeds every call is a miss or a dropped write
  (``skipped_calls``). The one GIL-holding setup (~1 s) remains.
- Mid-run: a failed RPC marks the store down for ``retry_interval_s``: calls in that window
  return at once (``skipped_calls``), then one call tries again. Measured with a killed
  master: exists/get fail at once (RPC_FAIL, -900), a put after ~4.4 s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.contract import POD_IP_ENV
from kvflow.runtime.cache.storage.base import (
    PageStore,
    StorageConfig,
    StoreCounters,
    StoreStats,
    _check_batch,
)
from kvflow.runtime.cache.storage.mooncake_config import (
    MooncakeStoreConfig,
    unreachable_endpoint,
)
from kvflow.runtime.cache.storage.page import (
    HEADER_BYTES,
    PageBuffer,
    buffer_address,
    byte_view,
    check_header,
    encode_header,
    payload_crc,
)
from kvflow.runtime.utils import mooncake_env

__all__ = ["MooncakeStore", "MooncakeStoreConfig", "open_mooncake_store"]

logger = logging.getLogger(__name__)

# Mooncake status codes (mooncake-store's ErrorCode).
NO_AVAILABLE_HANDLE = -200  # put: no room in any segment (declined, not an error)
INVALID_PARAMS = -600  # get: the object does not fit the buffers (a size mismatch)
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705  # put: the first object stays (stored, as far as we care)
LEASE_EXPIRED = -707  # get: bytes arrived but the lease ran out; asked once more
TRANSFER_FAIL = -800
ARENA_SLOTS = 256  # header slots per thread: the largest batch of one store call
# Store calls abandoned by close() keep their client alive here: destroying a client while a
# call still runs inside it would crash the process.
_ABANDONED: list[object] = []


def open_mooncake_store(config: StorageConfig) -> MooncakeStore:
    return MooncakeStore(MooncakeStoreConfig.resolve(config.path, config.mooncake_config_file))


class MooncakeStore(PageStore):
    """See the module docstring: zero-copy batches, background connect, a down window."""

    def __init__(self, config: MooncakeStoreConfig) -> None:
        self.config = config
        self.hostname = config.local_hostname or os.environ.get(POD_IP_ENV) or "127.0.0.1"
        self._counters = StoreCounters()
        self._lock = threading.Lock()
        self._client: Any = None  # set once setup succeeds
        self._closed = False
        self._down_until = 0.0
        self._regions: list[tuple[int, int]] = []  # (address, bytes) to register
        self._local = threading.local()  # per-thread header arena
        self._arenas: list[np.ndarray] = []
        mooncake_env.require("the Mooncake store", config.retry_interval_s, self.hostname)
        self._connector = threading.Thread(
            target=self._connect_loop, name="mooncake-store-connect", daemon=True
        )
        self._connector.start()

    # -- connection ---------------------------------------------------------------------

    def _connect_loop(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            logger.warning(
                "Mooncake store unavailable (%s): install mooncake-transfer-engine-non-cuda "
                "(CPU) or mooncake-transfer-engine (CUDA) and Debian's libibverbs1 and "
                "librdmacm1; serving continues without L3",
                exc,
            )
            return
        cfg = self.config
        warned = False
        while not self._closed:
            unreachable = unreachable_endpoint(cfg)
            if unreachable:
                self._counters.add(errors=1)
                log = logger.warning if not warned else logger.debug
                warned = True
                log(
                    "Mooncake store: %s does not accept connections; retrying in %.0f s, "
                    "serving without L3 meanwhile",
                    unreachable,
                    cfg.retry_interval_s,
                )
                time.sleep(cfg.retry_interval_s)
                continue
            client = MooncakeDistributedStore()
            status = client.setup(
                self.hostname,
                cfg.metadata_server,
                cfg.global_segment_size,
                cfg.local_buffer_size,
                cfg.protocol,
                cfg.device_name,
                cfg.master_server_address,
            )
            if status == 0:
                with self._lock:
                    if self._closed:
                        _ABANDONED.append(client)
                        return
                    self._client = client
                    for address, nbytes in self._regions:
                        self._register_locked(address, nbytes)
                logger.info("Mooncake store connected to %s", cfg.master_server_address)
                return
            _ABANDONED.append(client)
            self._counters.add(errors=1)
            logger.warning(
                "Mooncake store: setup against master %s failed (status %s); retrying in "
                "%.0f s, serving without L3 meanwhile",
                cfg.master_server_address,
                status,
                cfg.retry_interval_s,
            )
            time.sleep(cfg.retry_interval_s)

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the client is set up (tests, start-up logs); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._client is not None:
                return True
            time.sleep(0.05)
        return self._client is not None

    def _usable(self) -> Any:
        """The client if calls should be tried now, else None (counted as skipped)."""
        client = self._client
        if client is None or self._closed or time.monotonic() < self._down_until:
            self._counters.add(skipped_calls=1)
            return None
        return client

    def _failed(self, what: str, status: object) -> None:
        self._counters.add(errors=1)
        was_up = time.monotonic() >= self._down_until
        self._down_until = time.monotonic() + self.config.retry_interval_s
        if was_up:
            logger.warning(
                "Mooncake store: %s failed (%s); treating the store as down for %.0f s",
                what,
                status,
                self.config.retry_interval_s,
            )

    def _register_locked(self, address: int, nbytes: int) -> None:
        status = self._client.register_buffer(address, nbytes)
        if status != 0:
            logger.warning("Mooncake store: register_buffer(%d bytes) -> %s", nbytes, status)

    def register(self, buffer: PageBuffer) -> None:
        view = byte_view(buffer)
        region = (buffer_address(view), view.nbytes)
        with self._lock:
            self._regions.append(region)
            if self._client is not None:
                self._register_locked(*region)

    def _arena(self) -> np.ndarray:
        arena = getattr(self._local, "arena", None)
        if arena is None:
            arena = np.zeros(ARENA_SLOTS * HEADER_BYTES, dtype=np.uint8)
            self._local.arena = arena
            self.register(arena)
            with self._lock:
                self._arenas.append(arena)  # registered memory must outlive the client
        return arena

    # -- page operations ------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        client = self._usable()
        if client is None or not keys:
            return [False] * len(keys)
        try:
            statuses = client.batch_is_exist(list(keys))
        except Exception as exc:  # the binding raises on odd inputs; never into the caller
            self._failed("batch_is_exist", exc)
            return [False] * len(keys)
        if any(status < 0 for status in statuses):
            self._failed("batch_is_exist", min(statuses))
        return [status == 1 for status in statuses]

    def get(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        _check_batch(keys, buffers)
        found: list[bool] = []
        for start in range(0, len(keys), ARENA_SLOTS):
            end = start + ARENA_SLOTS
            found += self._get_batch(keys[start:end], buffers[start:end])
        return found

    def _get_batch(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        client = self._usable()
        if client is None or not keys:
            return [False] * len(keys)
        arena = self._arena()
        views = [byte_view(buffer) for buffer in buffers]
        base = buffer_address(arena)
        ptrs = [[base + i * HEADER_BYTES, buffer_address(v)] for i, v in enumerate(views)]
        sizes = [[HEADER_BYTES, v.nbytes] for v in views]
        try:
            statuses = client.batch_get_into_multi_buffers(list(keys), ptrs, sizes)
            retry = [i for i, status in enumerate(statuses) if status == LEASE_EXPIRED]
            if retry:
                again = client.batch_get_into_multi_buffers(
                    [keys[i] for i in retry], [ptrs[i] for i in retry], [sizes[i] for i in retry]
                )
                for i, status in zip(retry, again, strict=True):
                    statuses[i] = status
        except Exception as exc:
            self._failed("batch_get_into_multi_buffers", exc)
            return [False] * len(keys)
        found = []
        for i, (key, view, status) in enumerate(zip(keys, views, statuses, strict=True)):
            if status == HEADER_BYTES + view.nbytes:
                header = arena[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                crc = check_header(header, key, view.nbytes)
                ok = crc is not None and payload_crc(view) == crc
                if not ok:
                    self._counters.add(corrupt_pages=1)
                found.append(ok)
            elif status >= 0 or status == INVALID_PARAMS:  # an object of another size
                self._counters.add(corrupt_pages=1)
                found.append(False)
            elif status == TRANSFER_FAIL and self._size_differs(client, key, view.nbytes):
                self._counters.add(corrupt_pages=1)  # an object smaller than the buffers
                found.append(False)
            else:
                if status != OBJECT_NOT_FOUND:
                    self._failed("batch_get_into_multi_buffers", status)
                found.append(False)
        return found

    @staticmethod
    def _size_differs(client: Any, key: str, payload_len: int) -> bool:
        # NOTE: a get into buffers larger than the object fails as a whole transfer
        # (TRANSFER_FAIL, -800), as a real transfer failure does; its size tells them apart.
        try:
            size = client.get_size(key)
        except Exception:
            return False
        return bool(size >= 0 and size != HEADER_BYTES + payload_len)

    def put(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        _check_batch(keys, buffers)
        stored: list[bool] = []
        for start in range(0, len(keys), ARENA_SLOTS):
            end = start + ARENA_SLOTS
            stored += self._put_batch(keys[start:end], buffers[start:end])
        return stored

    def _put_batch(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        client = self._usable()
        if client is None or not keys:
            return [False] * len(keys)
        arena = self._arena()
        views = [byte_view(buffer) for buffer in buffers]
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            arena[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] = np.frombuffer(
                encode_header(key, view), dtype=np.uint8
            )
        base = buffer_address(arena)
        ptrs = [[base + i * HEADER_BYTES, buffer_address(v)] for i, v in enumerate(views)]
        sizes = [[HEADER_BYTES, v.nbytes] for v in views]
        try:
            statuses = client.batch_put_from_multi_buffers(list(keys), ptrs, sizes)
        except Exception as exc:
            self._failed("batch_put_from_multi_buffers", exc)
            return [False] * len(keys)
        stored = []
        for status in statuses:
            if status == 0 or status == OBJECT_ALREADY_EXISTS:
                stored.append(True)
                continue
            if status == NO_AVAILABLE_HANDLE:
                self._counters.add(declined_pages=1)
            else:
                self._failed("batch_put_from_multi_buffers", status)
            stored.append(False)
        return stored

    def stats(self) -> StoreStats:
        available = (
            self._client is not None and not self._closed and time.monotonic() >= self._down_until
        )
        return self._counters.snapshot(available=available)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the client on a helper thread, waiting at most ``timeout_s`` (closing
        against a dead master took ~7 s); an unfinished close is abandoned, not stopped."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is None:
            return
        # The client and its registered arenas stay referenced until its close has returned.
        kept = (client, self._arenas)
        _ABANDONED.append(kept)

        def close_client() -> None:
            client.close()
            _ABANDONED.remove(kept)

        closer = threading.Thread(target=close_client, name="mooncake-store-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
