"""Upstream release binaries over HTTPS, for machines that can reach the release hosts."""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..log import elapsed, say
from ..versions import K8sVersions
from .source import BinarySource, SourceUnavailable, go_arch

__all__ = ["DownloadSource"]


@dataclass(frozen=True)
class _Artifact:
    url: str
    member: str | None = None  # path of the binary inside a .tar.gz, if archived
    sha256_url: str | None = None


def _artifacts(v: K8sVersions, arch: str) -> dict[str, _Artifact]:
    kube = f"https://dl.k8s.io/release/v{v.kubernetes}/bin/linux/{arch}"
    arts = {
        name: _Artifact(f"{kube}/{name}", sha256_url=f"{kube}/{name}.sha256")
        for name in (
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubectl",
            "kubelet",
        )
    }
    etcd = f"etcd-v{v.etcd}-linux-{arch}"
    arts["etcd"] = _Artifact(
        f"https://github.com/etcd-io/etcd/releases/download/v{v.etcd}/{etcd}.tar.gz",
        member=f"{etcd}/etcd",
    )
    arts["kwok"] = _Artifact(
        f"https://github.com/kubernetes-sigs/kwok/releases/download/v{v.kwok}/kwok-linux-{arch}"
    )
    helm = f"https://get.helm.sh/helm-v{v.helm}-linux-{arch}.tar.gz"
    arts["helm"] = _Artifact(helm, member=f"linux-{arch}/helm", sha256_url=f"{helm}.sha256sum")
    return arts


class DownloadSource(BinarySource):
    """Release binaries from dl.k8s.io, GitHub releases and get.helm.sh.

    A HEAD request to the first artifact probes the hosts: if it does not answer within
    `timeout_s`, the whole source is skipped (this is the common case on machines
    that reach package registries only), so a failed probe costs seconds.
    """

    label = "upstream download"

    def __init__(self, versions: K8sVersions, timeout_s: float) -> None:
        self._arts = _artifacts(versions, go_arch())
        self._timeout_s = timeout_s
        self.provides = frozenset(self._arts)

    def fetch(self, names: frozenset[str], staging: Path) -> dict[str, Path]:
        if self._timeout_s <= 0:
            raise SourceUnavailable("downloads disabled (KVFLOW_K8S_DOWNLOAD_TIMEOUT=0)")
        first = self._arts[min(names)]
        reason = self._probe(first.url)
        if reason:
            raise SourceUnavailable(f"{first.url}: {reason}")
        out: dict[str, Path] = {}
        for name in sorted(names):
            art = self._arts[name]
            start = time.monotonic()
            try:
                payload = self._get(art.url)
            except OSError as err:
                say(f"download of {name} failed ({err}); leaving it to the next source")
                continue
            if art.sha256_url:
                want = self._get(art.sha256_url).decode().split()[0]
                got = hashlib.sha256(payload).hexdigest()
                if want != got:
                    raise SourceUnavailable(f"{art.url}: sha256 {got} != published {want}")
            if art.member:
                payload = _untar_member(payload, art.member)
            path = staging / name
            path.write_bytes(payload)
            path.chmod(0o755)
            out[name] = path
            say(f"downloaded {name} in {elapsed(start)}")
        return out

    def _probe(self, url: str) -> str | None:
        """Why `url` cannot be fetched within the timeout, or None if it answers.

        Runs in a daemon thread so that a slow DNS lookup, which the socket timeout
        does not bound, cannot hold the caller up either.
        """
        outcome: list[str | None] = []

        def attempt() -> None:
            try:
                request = urllib.request.Request(url, method="HEAD")
                with urllib.request.urlopen(request, timeout=self._timeout_s):
                    outcome.append(None)
            except OSError as err:
                outcome.append(str(err))

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(self._timeout_s + 1)
        return outcome[0] if outcome else f"no answer within {self._timeout_s:g}s"

    def _get(self, url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=self._timeout_s) as response:
            return bytes(response.read())


def _untar_member(archive: bytes, member: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        handle = tar.extractfile(member)
        if handle is None:
            raise SourceUnavailable(f"{member} is not a file in the archive")
        return handle.read()
