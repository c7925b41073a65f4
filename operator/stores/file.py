"""The file store: pages as files on a shared volume.

In the cluster the volume is a ReadWriteMany PersistentVolumeClaim ``<name>-hicache``
that every store client mounts; under ``kvflow up``, a directory of its state directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import names
from ..paths import HICACHE_DIR
from ..spec import SpecError
from .base import LocalStore, Manifest, SharedStore, StoreClient

CLAIM = "hicache"  # component of the claim's name, and the pods' volume name


class FileStore(SharedStore):
    """Pages as files on a shared volume (``spec.hiCache.sharedStore.size`` big)."""

    cluster_only_fields = ("hiCache.sharedStore.storageClassName",)

    def check(self) -> None:
        if not self.md.hicache.store_size:
            raise SpecError("spec.hiCache.sharedStore.size", "required when the store type is file")

    def cluster_client(self) -> StoreClient:
        return StoreClient(HICACHE_DIR)

    def worker_volumes(self) -> tuple[list[Manifest], list[Manifest]]:
        claim = names.child_name(self.md.name, CLAIM)
        volume = {"name": CLAIM, "persistentVolumeClaim": {"claimName": claim}}
        return [volume], [{"name": CLAIM, "mountPath": HICACHE_DIR}]

    def claims(self) -> list[Manifest]:
        """PVC ``<name>-hicache``, ReadWriteMany: every store client reads and writes it.

        It is owned by the ModelDeployment, so deleting the deployment deletes the cache too
        (the cache is rebuildable; keeping it would leak storage).
        """
        md = self.md
        spec: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": md.hicache.store_size}},
        }
        if md.hicache.storage_class:
            spec["storageClassName"] = md.hicache.storage_class
        claim = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": names.object_meta(md, names.child_name(md.name, CLAIM), CLAIM),
            "spec": spec,
        }
        return [claim]

    def local(self, state_dir: Path, free_port: Callable[[], int]) -> LocalStore:
        directory = state_dir / CLAIM
        directory.mkdir(parents=True, exist_ok=True)
        return LocalStore(StoreClient(str(directory)))
