"""HiCache's shared storage tier (L3): page keys, the page store contract, its backends
(``file``, ``mooncake``; chosen by ``--hicache-storage`` through :data:`STORAGE_BACKENDS`)
and the background I/O worker the scheduler drives. See docs/hicache-storage.md."""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports
from kvflow.runtime.cache.storage.base import (
    STORAGE_BACKENDS,
    PageStore,
    StorageConfig,
    StoreStats,
    create_store,
    leading_count,
)
from kvflow.runtime.cache.storage.keys import StoreNamespace, page_keys
from kvflow.runtime.cache.storage.metrics import LATENCY_BUCKETS_S, IOStats, LatencySummary

if TYPE_CHECKING:
    from kvflow.runtime.cache.storage.io import Completion, IOConfig, JobKind, Outcome, StorageIO
    from kvflow.runtime.cache.storage.page import HEADER_BYTES
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(
        __name__,
        {
            ".io": ("Completion", "IOConfig", "JobKind", "Outcome", "StorageIO"),
            ".page": ("HEADER_BYTES",),
        },
    )

__all__ = [
    "HEADER_BYTES",
    "LATENCY_BUCKETS_S",
    "STORAGE_BACKENDS",
    "Completion",
    "IOConfig",
    "IOStats",
    "JobKind",
    "LatencySummary",
    "Outcome",
    "PageStore",
    "StorageConfig",
    "StorageIO",
    "StoreNamespace",
    "StoreStats",
    "create_store",
    "leading_count",
    "page_keys",
]
