"""Environment knobs of the Kubernetes harness, each declared once."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["K8sEnv"]


@dataclass(frozen=True)
class K8sEnv:
    """Where binaries come from and where caches live.

    - `KVFLOW_K8S_BIN_DIR`: a directory of ready binaries, searched first.
    - `KVFLOW_CACHE_DIR` (default `~/.cache/kvflow`): binaries go to
      `<cache>/k8s/<kubernetes version>/bin`, Go's module and build caches to `<cache>/go`.
    - `KVFLOW_K8S_DOWNLOAD_TIMEOUT` (seconds, default 3): how long an upstream release
      download may take to answer before it is skipped; `0` skips downloads.
    - `KVFLOW_GO`: the go command (default: `go` on PATH, else /usr/local/go/bin/go).
    - `KVFLOW_K8S_STATE_DIR` (default `.cache/k8s-cluster`): state of `python -m e2e.k8s up`.
    """

    bin_dir: Path | None
    cache_dir: Path
    download_timeout_s: float
    go: str
    state_dir: Path

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> K8sEnv:
        bin_dir = environ.get("KVFLOW_K8S_BIN_DIR") or None
        cache_dir = environ.get("KVFLOW_CACHE_DIR") or "~/.cache/kvflow"
        go = environ.get("KVFLOW_GO") or shutil.which("go") or "/usr/local/go/bin/go"
        return cls(
            bin_dir=Path(bin_dir).expanduser() if bin_dir else None,
            cache_dir=Path(cache_dir).expanduser(),
            download_timeout_s=float(environ.get("KVFLOW_K8S_DOWNLOAD_TIMEOUT", "3")),
            go=go,
            state_dir=Path(environ.get("KVFLOW_K8S_STATE_DIR") or ".cache/k8s-cluster"),
        )

    @property
    def go_dir(self) -> Path:
        """GOPATH, GOMODCACHE and GOCACHE live here, so rebuilds are incremental."""
        return self.cache_dir / "go"
