"""Configuration of a real node: frozen, with its state layout as properties."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REAL_NODE_LABEL", "REAL_NODE_TAINT", "NodePorts", "RealNodeConfig"]

# Every real node carries this label, and (unless `taint=False`) a NoSchedule taint with
# the same key: pods land there only when they ask for it (a toleration plus a node
# selector), so tests written for the simulated kwok nodes never start real containers.
REAL_NODE_LABEL = "kvflow.dev/real-node"
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}


@dataclass(frozen=True)
class NodePorts:
    """Loopback ports of one real node, picked free at start."""

    kubelet: int
    kubelet_healthz: int


@dataclass(frozen=True)
class RealNodeConfig:
    """Where a real node (containerd + kubelet) keeps its state, and its identity.

    Layout of `state_dir`: `containerd/` (config, socket, root, state, runc root),
    `cni/` (the loopback-only network config), `images/` (OCI layouts and tars built
    here), `kubelet/` (config, root dir, certificates, pod logs), `logs/`.

    Pods on the node get a cgroup subtree of their own (`cgroup_root`), so the
    teardown finds every container process and two nodes on one machine (two test
    sessions) never share cgroups.
    """

    state_dir: Path
    name: str = "real-node"
    taint: bool = True
    ready_timeout_s: float = 90.0

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
