"""The contract of an L3 page store, its configuration and the registry of backends."""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.contract import MOONCAKE_CONFIG_ENV
from kvflow.runtime.utils.registry import Registry

if TYPE_CHECKING:
    from kvflow.runtime.cache.storage.page import PageBuffer

__all__ = [
    "STORAGE_BACKENDS",
    "PageStore",
    "StorageConfig",
    "StoreCounters",
    "StoreStats",
    "create_store",
    "leading_count",
]


@dataclass(frozen=True)
class StorageConfig:
    """``--hicache-storage`` and ``--hicache-storage-path``, resolved once at parse time.

    ``path``: the file store's directory, or the Mooncake master's ``host:port``.
    ``mooncake_config_file``: ``$KVFLOW_MOONCAKE_CONFIG`` (the operator's ``mooncake.json``).
    ``max_bytes``: the file store's size bound; None means 90% of its volume.
    """

    backend: str
    path: str = ""
    mooncake_config_file: str | None = None
    max_bytes: int | None = None

    @classmethod
    def from_flags(
        cls,
        storage: str,
        path: str = "",
        env: Mapping[str, str] = os.environ,
        max_bytes: int | None = None,
    ) -> StorageConfig:
        if storage not in STORAGE_BACKENDS.choices():
            raise ValueError(
                f"--hicache-storage {storage!r}: choose from {STORAGE_BACKENDS.choices()}"
            )
        config_file = env.get(MOONCAKE_CONFIG_ENV) or None
        if storage == "file" and not path:
            raise ValueError("--hicache-storage file needs --hicache-storage-path (a directory)")
        if storage == "mooncake" and not path and not config_file:
            raise ValueError(
                f"--hicache-storage mooncake needs --hicache-storage-path (the master's "
                f"host:port) or ${MOONCAKE_CONFIG_ENV}"
            )
        return cls(storage, path, config_file, max_bytes)


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's counters (monotonic since it opened, but ``usage_bytes``).

    ``errors``: failed store calls or page operations (I/O errors, RPC failures).
    ``corrupt_pages``: pages read back with a wrong size, key or checksum (served as misses).
    ``skipped_calls``: calls answered as misses/dropped without trying, the store being down.
    ``declined_pages``: writes the store refused for lack of room (not errors).
    ``usage_bytes``: bytes held, where the backend knows (else -1).
    """

    available: bool
    errors: int = 0
    corrupt_pages: int = 0
    skipped_calls: int = 0
    declined_pages: int = 0
    evicted_pages: int = 0
    usage_bytes: int = -1


class StoreCounters:
    """Thread-safe counters behind :class:`StoreStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors = 0
        self.corrupt_pages = 0
        self.skipped_calls = 0
        self.declined_pages = 0
        self.evicted_pages = 0

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self, available: bool, usage_bytes: int = -1) -> StoreStats:
        with self._lock:
            return StoreStats(
                available=available,
                errors=self.errors,
                corrupt_pages=self.corrupt_pages,
                skipped_calls=self.skipped_calls,
                declined_pages=self.declined_pages,
                evicted_pages=self.evicted_pages,
                usage_bytes=usage_bytes,
            )


class PageStore(ABC):
    """A shared store of KV pages, addressed by page key (see ``keys.page_keys``).

    Batches: ``keys[i]`` goes with ``buffers[i]``; each buffer is one page's bytes (a
    contiguous CPU tensor, numpy array, bytearray or memoryview; its size is the page size).

    Failure contract: the store being slow, unreachable or corrupt never raises out of these
    methods. A failed read is a miss (False), a failed write is dropped (False), and both are
    counted in :meth:`stats`. Only caller errors raise (ValueError: lengths differ, a key too
    long, a buffer that cannot be viewed in place).

    Buffers: during :meth:`get`, a buffer whose page is a miss may have been written
    partially; its content is undefined. During :meth:`put`, buffers are only read.

    Threads: every method may be called from several threads at once. Calls may block on
    I/O; callers on a latency-critical path go through ``io.StorageIO``.
    """

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present (a later :meth:`get` may still miss: eviction,
        corruption)."""

    @abstractmethod
    def get(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        """Read each page into its buffer; True where the page arrived whole and verified."""

    @abstractmethod
    def put(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        """Store each buffer under its key; True where the page is stored (already present
        counts). A present key keeps its stored object."""

    def register(self, buffer: PageBuffer) -> None:  # noqa: B027 (an optional hook)
        """Hint: page buffers of later calls lie inside ``buffer`` (e.g. the whole host KV
        pool), so backends with registered memory can transfer to and from it directly."""

    @abstractmethod
    def stats(self) -> StoreStats: ...

    @abstractmethod
    def close(self) -> None:
        """Release the store; bounded in time even when the store is unreachable."""


def leading_count(flags: Sequence[bool]) -> int:
    """Length of the leading run of True in ``flags`` (the usable prefix of a page run)."""
    for index, flag in enumerate(flags):
        if not flag:
            return index
    return len(flags)


def _check_batch(keys: Sequence[str], buffers: Sequence[PageBuffer]) -> None:
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")


STORAGE_BACKENDS: Registry[PageStore] = Registry("HiCache storage backend")
STORAGE_BACKENDS.register("file", "kvflow.runtime.cache.storage.file:open_file_store")
STORAGE_BACKENDS.register("mooncake", "kvflow.runtime.cache.storage.mooncake:open_mooncake_store")


def create_store(config: StorageConfig) -> PageStore:
    """Open the backend named by ``config.backend``. Never blocks on an unreachable store:
    the Mooncake client connects in the background and answers misses until it is up."""
    return STORAGE_BACKENDS.get(config.backend)(config)
