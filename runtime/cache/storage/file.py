"""The ``file`` store: one file per page in a directory on a (shared) volume.

Layout (``root`` is ``--hicache-storage-path``)::

    root/pages/<h0h1>/<h2h3>/<key>      one page object (header + payload, see ``page``)
    root/pages/<h0h1>/<h2h3>/.tmp-...   a write in progress (renamed into place)
    root/.evict.lock                    held (flock) by the process evicting

``h`` is a BLAKE2b digest of the key, spreading pages over 65536 directories.

Concurrency: a page is written to a temporary file in its final directory and renamed
onto its key with ``os.replace``, so readers in any process see either no page or a whole
one, and concurrent writers of one key leave one whole copy. Files may vanish under a reader
(another process evicted them): a vanished file is a miss, an open file stays readable.

Size bound: each process keeps an estimate of the directory's size (scanned at open, then
its own writes added). When it passes ``max_bytes``, or every ``rescan_interval_s`` on a
write, the process takes the eviction lock (skipping if another process holds it), scans,
and deletes the least recently used pages (oldest mtime; reads touch mtime, as atime is
often off) until the size is under ``evict_to`` x ``max_bytes``. Other processes' writes
count from that scan on, so the bound holds within the writes made between two scans.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvflow.runtime.cache.storage.base import (
    PageStore,
    StorageConfig,
    StoreCounters,
    StoreStats,
    _check_batch,
)
from kvflow.runtime.cache.storage.page import (
    HEADER_BYTES,
    PageBuffer,
    byte_view,
    check_header,
    encode_header,
    payload_crc,
)

__all__ = ["FileStore", "FileStoreConfig", "open_file_store"]

logger = logging.getLogger(__name__)

_KEY = re.compile(r"^[A-Za-z0-9_-]{1,106}$")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class FileStoreConfig:
    """``max_bytes`` None: 90% of the volume holding ``root`` (its ``statvfs`` size).
    ``tmp_max_age_s``: temporary files older than this are a crashed writer's, removed by
    eviction scans. ``fsync``: flush each page to stable storage before renaming it."""

    root: Path
    max_bytes: int | None = None
    evict_to: float = 0.9
    rescan_interval_s: float = 30.0
    tmp_max_age_s: float = 300.0
    fsync: bool = False


def open_file_store(config: StorageConfig) -> FileStore:
    return FileStore(FileStoreConfig(Path(config.path), max_bytes=config.max_bytes))


class FileStore(PageStore):
    """See the module docstring for layout, concurrency and the size bound."""

    def __init__(self, config: FileStoreConfig) -> None:
        self.config = config
        self.pages_dir = config.root / "pages"
        self.pages_dir.mkdir(parents=True, exist_ok=True)
        if config.max_bytes is None:
            volume = os.statvfs(config.root)
            self.max_bytes = int(0.9 * volume.f_blocks * volume.f_frsize)
        else:
            self.max_bytes = config.max_bytes
        self._counters = StoreCounters()
        self._lock = threading.Lock()  # usage estimate and scan time
        self._evict_lock = threading.Lock()  # one evicting thread per process
        self._usage = 0
        self._last_scan = 0.0
        self._scan_and_evict()

    def _path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"page key {key!r} is not 1-106 characters of [A-Za-z0-9_-]")
        shard = hashlib.blake2b(key.encode(), digest_size=2).hexdigest()
        return self.pages_dir / shard[:2] / shard[2:] / key

    def exists(self, keys: Sequence[str]) -> list[bool]:
        present = []
        for key in keys:
            path = self._path(key)
            try:
                present.append(path.stat().st_size > HEADER_BYTES)
            except FileNotFoundError:
                present.append(False)
            except OSError:
                self._counters.add(errors=1)
                present.append(False)
        return present

    def get(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        _check_batch(keys, buffers)
        return [self._get_one(key, buffer) for key, buffer in zip(keys, buffers, strict=True)]

    def _get_one(self, key: str, buffer: PageBuffer) -> bool:
        path = self._path(key)
        payload = byte_view(buffer)
        try:
            # Sizes are checked by reading, not by fstat: the object must end exactly
            # after the payload (one more read returns nothing).
            with open(path, "rb") as page_file:
                header = page_file.read(HEADER_BYTES)
                crc = check_header(header, key, payload.nbytes)
                if crc is None:
                    return self._corrupt(path, "header or size")
                if page_file.readinto(payload.data) != payload.nbytes or page_file.read(1):
                    return self._corrupt(path, "size")
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.warning("file store: reading %s failed: %s", path, exc)
            self._counters.add(errors=1)
            return False
        if payload_crc(payload) != crc:
            return self._corrupt(path, "checksum")
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for LRU eviction
        return True

    def _corrupt(self, path: Path, why: str) -> bool:
        logger.warning("file store: page %s is corrupt (%s); removed, served as a miss", path, why)
        self._counters.add(corrupt_pages=1)
        with contextlib.suppress(OSError):
            path.unlink()
        return False

    def put(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        _check_batch(keys, buffers)
        stored, written_bytes = [], 0
        for key, buffer in zip(keys, buffers, strict=True):
            ok, nbytes = self._put_one(key, buffer)
            stored.append(ok)
            written_bytes += nbytes
        with self._lock:
            self._usage += written_bytes
            due = self._usage > self.max_bytes or (
                time.monotonic() - self._last_scan > self.config.rescan_interval_s
            )
        if due:
            self._scan_and_evict()
        return stored

    def _put_one(self, key: str, buffer: PageBuffer) -> tuple[bool, int]:
        path = self._path(key)
        payload = byte_view(buffer)
        header = encode_header(key, payload)
        with contextlib.suppress(OSError):
            if path.stat().st_size == HEADER_BYTES + payload.nbytes:
                os.utime(path)  # present: keep it, refresh its recency
                return True, 0
        tmp = path.parent / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for chunk in (memoryview(header), memoryview(payload)):
                    done = 0
                    while done < len(chunk):
                        done += os.write(fd, chunk[done:])
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("file store: writing %s failed: %s", path, exc)
            self._counters.add(errors=1)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False, 0
        return True, HEADER_BYTES + payload.nbytes

    def _scan_and_evict(self) -> None:
        """Rescan the directory; evict LRU pages if over the bound. Skips when another thread
        or process is already doing it."""
        if not self._evict_lock.acquire(blocking=False):
            return
        try:
            lock_path = self.config.root / ".evict.lock"
            with open(lock_path, "a+b") as lock_file:
                try:
                    fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return
                try:
                    usage = self._evict_locked()
                finally:
                    fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
            with self._lock:
                self._usage = usage
                self._last_scan = time.monotonic()
        except OSError as exc:
            logger.warning("file store: eviction scan of %s failed: %s", self.pages_dir, exc)
            self._counters.add(errors=1)
        finally:
            self._evict_lock.release()

    def _evict_locked(self) -> int:
        now = time.time()
        pages: list[tuple[float, int, str]] = []
        usage = 0
        for entry in _walk_files(self.pages_dir):
            try:
                info = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.startswith(_TMP_PREFIX):
                if now - info.st_mtime > self.config.tmp_max_age_s:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                continue
            pages.append((info.st_mtime, info.st_size, entry.path))
            usage += info.st_size
        if usage <= self.max_bytes:
            return usage
        target = int(self.config.evict_to * self.max_bytes)
        pages.sort()
        evicted = 0
        for _, size, path in pages:
            if usage <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                evicted += 1
            usage -= size  # gone either way: by us or by another process
        self._counters.add(evicted_pages=evicted)
        logger.info("file store: evicted %d pages, %d bytes left", evicted, usage)
        return usage

    def usage_bytes(self) -> int:
        """This process's estimate of the directory's size (exact after a scan)."""
        with self._lock:
            return self._usage

    def stats(self) -> StoreStats:
        return self._counters.snapshot(available=True, usage_bytes=self.usage_bytes())

    def close(self) -> None:
        pass


def _walk_files(root: Path):
    """Files two directory levels under ``root`` (the shards), tolerating concurrent removal."""
    for level1 in _scandir(root):
        if level1.is_dir(follow_symlinks=False):
            for level2 in _scandir(level1.path):
                if level2.is_dir(follow_symlinks=False):
                    for entry in _scandir(level2.path):
                        if entry.is_file(follow_symlinks=False):
                            yield entry


def _scandir(path: str | Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
