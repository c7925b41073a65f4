"""Configuration of a real node: frozen, with its state layout as properties."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "POD_NETWORK_LABEL_VALUE",
    "REAL_NODE_LABEL",
    "REAL_NODE_TAINT",
    "NodePorts",
    "PodNetwork",
    "RealNodeConfig",
]

# Every real node carries this label, and (unless `taint=False`) a NoSchedule taint with
# the same key: pods land there only when they ask for it (a toleration plus a node
# selector), so tests written for the simulated kwok nodes never start real containers.
REAL_NODE_LABEL = "kvflow.dev/real-node"
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
# A node with a pod network carries the same key with this value (label and taint), so
# pods placed for the host-network node never land on it, nor the other way round.
POD_NETWORK_LABEL_VALUE = "pod-network"


@dataclass(frozen=True)
class PodNetwork:
    """Real pod networking, kept inside a network namespace the harness creates.

    containerd and the kubelet run in that namespace (`netns`, under /var/run/netns);
    a bridge CNI gives pods addresses from `subnet`, the bridge holding the first one
    as the pods' gateway. Nothing non-loopback exists in the root namespace: relays
    (`e2e.k8s.realnode.relay`) join the two. Inside the namespace the apiserver is
    served on 127.0.0.1 at its own port (for the kubelet) and on `service_ip`:443 (the
    `kubernetes` Service's ClusterIP, named in the apiserver's certificate), so pods use
    the in-cluster settings the kubelet injects, with no kube-proxy. The kubelet's
    ports are relayed back to root loopback (logs, exec, health). CoreDNS serves the
    cluster's names at `dns_ip` (another address on the namespace's loopback, the
    kubelet's `clusterDNS`; `e2e.k8s.realnode.dns`).
    """

    service_ip: str
    dns_ip: str
    subnet: str = "10.244.200.0/24"


@dataclass(frozen=True)
class NodePorts:
    """Loopback ports of one real node, picked free at start."""

    kubelet: int
    kubelet_healthz: int
    dns_ready: int  # CoreDNS's readiness endpoint (pod-network mode)


@dataclass(frozen=True)
class RealNodeConfig:
    """Where a real node (containerd + kubelet) keeps its state, and its identity.

    Layout of `state_dir`: `containerd/` (config, socket, root, state, runc root),
    `cni/` (the network config: loopback only, or a bridge in pod-network mode), `images/` (OCI layouts and tars built
    here), `kubelet/` (config, root dir, certificates, pod logs), `logs/`.

    Pods on the node get a cgroup subtree of their own (`cgroup_root`), so the
    teardown finds every container process and two nodes on one machine (two test
    sessions) never share cgroups.
    """

    state_dir: Path
    name: str = "real-node"
    taint: bool = True
    ready_timeout_s: float = 90.0
    pod_network: PodNetwork | None = None

    @property
    def label_value(self) -> str:
        """This node's value of `REAL_NODE_LABEL` (and of its taint)."""
        return "true" if self.pod_network is None else POD_NETWORK_LABEL_VALUE

    @property
    def taint_spec(self) -> dict[str, str]:
        return {**REAL_NODE_TAINT, "value": self.label_value}

    @property
    def netns(self) -> str:
        """The name of the node's network namespace (pod-network mode)."""
        return self.cgroup_root.lstrip("/")

    @property
    def netns_path(self) -> Path:
        return Path("/var/run/netns") / self.netns

    @property
    def containerd_dir(self) -> Path:
        return self.state_dir / "containerd"

    @property
    def containerd_config(self) -> Path:
        return self.containerd_dir / "config.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd_dir / "containerd.sock"

    @property
    def cni_dir(self) -> Path:
        return self.state_dir / "cni"

    @property
    def images_dir(self) -> Path:
        return self.state_dir / "images"

    @property
    def kubelet_dir(self) -> Path:
        return self.state_dir / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.kubelet_dir / "config.yaml"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def cgroup_root(self) -> str:
        """The node's pod cgroup parent, the same path under every v1 controller."""
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:10]
        return f"/kvflow-{self.name}-{digest}"
