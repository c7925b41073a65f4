"""Configuration of a local control plane: frozen, with derived paths as properties."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ControlPlaneConfig", "FakeNodeSpec", "Ports"]


@dataclass(frozen=True)
class FakeNodeSpec:
    """Capacity every kwok-simulated node reports (GPU nodes of a serving cluster)."""

    cpu: str = "64"
    memory: str = "512Gi"
    pods: str = "110"
    gpus: int = 8


@dataclass(frozen=True)
class ControlPlaneConfig:
    """Where a control plane keeps its state and what it simulates.

    Layout of `state_dir`: `kubeconfig`, `pki/`, `etcd/` (data), `logs/<component>.log`,
    `kwok.yaml` (kwok's stages), `helm/` (helm's cache and config for this cluster).
    """

    state_dir: Path
    node_count: int = 3
    node: FakeNodeSpec = field(default_factory=FakeNodeSpec)
    service_cidr: str = "10.96.0.0/16"
    # NOTE: kwok hands out pod IPs from a loopback range on purpose. Nothing runs
    # behind a simulated pod, so a client that dials one (a router discovering pods)
    # fails on this machine, or reaches a local process a test bound to that address,
    # instead of sending packets to a private network. The price: EndpointSlices
    # reject loopback addresses, so Services get no endpoints.
    pod_cidr: str = "127.224.0.0/16"
    ready_timeout_s: float = 120.0

    @property
    def service_ip(self) -> str:
        """The `kubernetes` Service's ClusterIP: the first host of the service range."""
        return str(next(ipaddress.ip_network(self.service_cidr).hosts()))

    @property
    def dns_ip(self) -> str:
        """The cluster DNS's ClusterIP (`kube-system/kube-dns`): the tenth host of the
        service range, as kubeadm picks it."""
        return str(ipaddress.ip_network(self.service_cidr)[10])

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def etcd_dir(self) -> Path:
        return self.state_dir / "etcd"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def kwok_config(self) -> Path:
        return self.state_dir / "kwok.yaml"

    @property
    def helm_dir(self) -> Path:
        return self.state_dir / "helm"


@dataclass(frozen=True)
class Ports:
    """Loopback ports of one control plane, picked free at start."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
