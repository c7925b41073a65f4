"""The binary cache: `<cache>/k8s/<kubernetes version>/bin`, filled atomically."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..versions import K8sVersions

__all__ = ["BinCache"]

_MANIFEST = ".versions.json"


class BinCache:
    """Cached binaries plus a manifest naming the version each one was built at.

    A binary counts as cached only when the manifest records the version pinned for
    it now, so bumping one pin (say kwok) rebuilds that binary alone. Files enter
    `bin/` by `os.replace` from a staging directory on the same file system, so a
    reader never sees half a binary; `lock()` serializes concurrent fillers.
    """

    def __init__(self, cache_dir: Path, versions: K8sVersions) -> None:
        self.root = cache_dir / "k8s" / versions.kubernetes
        self.bin_dir = self.root / "bin"
        self._versions = versions

    def get(self, name: str) -> Path | None:
        path = self.bin_dir / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            return None
        if self._manifest().get(name) != self._versions.of(name):
            return None
        return path

    def install(self, name: str, built: Path) -> Path:
        """Move `built` (inside a `staging()` dir) into `bin/` and record its version."""
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        target = self.bin_dir / name
        built.chmod(0o755)
        os.replace(built, target)
        manifest = self._manifest()
        manifest[name] = self._versions.of(name)
        tmp = self.bin_dir / f"{_MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.bin_dir / _MANIFEST)
        return target

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh directory next to `bin/` (same file system), removed afterwards."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="staging-", dir=self.root))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive lock across processes (two pytest sessions building at once)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _manifest(self) -> dict[str, str]:
        try:
            return dict(json.loads((self.bin_dir / _MANIFEST).read_text()))
        except (OSError, ValueError):
            return {}
