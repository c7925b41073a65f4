"""The file-store PersistentVolumeClaim (HiCache L3 on a shared volume)."""

from __future__ import annotations

from typing import Any

from . import names
from .spec import ModelDeployment


def hicache_claim(md: ModelDeployment) -> dict[str, Any]:
    """PVC ``<name>-hicache``, ReadWriteMany: every runtime pod reads and writes it.

    It is owned by the ModelDeployment, so deleting the deployment deletes the cache too
    (the cache is rebuildable; keeping it would leak storage).
    """
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": md.hicache.store_size}},
    }
    if md.hicache.storage_class:
        spec["storageClassName"] = md.hicache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": names.object_meta(md, names.child_name(md.name, "hicache"), "hicache"),
        "spec": spec,
    }
