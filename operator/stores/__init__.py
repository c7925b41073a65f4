"""HiCache's shared stores (L3) as the operator deploys them: one module per store.

``spec.hiCache.sharedStore.type`` names a store kind of :data:`STORES`, the operator's
mirror of the runtime's ``STORAGE_BACKENDS`` (a test checks they list the same kinds), or
``none``. :func:`shared_store` hands back the deployment's :class:`SharedStore`; the rest
of the operator asks it and never compares the kind.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from kvflow import contract

from ..spec import ModelDeployment
from .base import LocalStore, SharedStore, StoreClient, StoreProcess

__all__ = [
    "STORES",
    "LocalStore",
    "SharedStore",
    "StoreClient",
    "StoreProcess",
    "shared_store",
    "store_type",
]

# kind -> "module:class" in this package, imported on first use.
STORES: Mapping[str, str] = {
    "file": ".file:FileStore",
    "mooncake": ".mooncake:MooncakeStore",
}


def store_type(kind: str) -> type[SharedStore]:
    """The store class of ``kind``; ValueError for a kind that is not registered."""
    if kind not in STORES:
        raise ValueError(f"unknown shared store {kind!r}; choose from {sorted(STORES)}")
    module, _, name = STORES[kind].partition(":")
    store: type[SharedStore] = getattr(importlib.import_module(module, __name__), name)
    return store


def shared_store(md: ModelDeployment) -> SharedStore | None:
    """The deployment's shared store; None when it has none."""
    kind = md.hicache.store
    return None if kind == contract.NO_STORAGE else store_type(kind)(md)
