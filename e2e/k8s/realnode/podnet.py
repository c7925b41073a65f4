"""Pod-network mode of a real node: the network namespace it runs in, its bridge CNI
network, and the relays that join the namespace to root loopback.

Every non-loopback address (the bridge, the pods, the veths' node ends, the `kubernetes`
Service's ClusterIP) lives inside the namespace the harness creates; nothing is added to
the root namespace but loopback listeners.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from ..process import Component
from .capability import CNI_BIN_DIR
from .config import NodePorts, PodNetwork, RealNodeConfig
from .relay import Endpoint, Rule

__all__ = [
    "BRIDGE",
    "create_netns",
    "delete_netns",
    "in_netns",
    "node_relay_rules",
    "pod_network_conflist",
    "pod_network_missing",
    "relay_component",
    "write_pod_network",
]

BRIDGE = "kvflow0"
_RELAY_SCRIPT = Path(__file__).with_name("relay.py")
_COMMANDS = ("ip", "nsenter")
_PLUGINS = ("bridge", "host-local", "loopback")


def pod_network_missing() -> str | None:
    """None when pod-network mode can run here; else what is missing."""
    missing = [c for c in _COMMANDS if shutil.which(c) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian's iproute2 and util-linux)"
    plugins = [p for p in _PLUGINS if not (CNI_BIN_DIR / p).is_file()]
    if plugins:
        return f"no CNI {', '.join(plugins)} plugin in {CNI_BIN_DIR} (containernetworking-plugins)"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def create_netns(cfg: RealNodeConfig, net: PodNetwork) -> None:
    """Create the node's network namespace (a leftover of the same name is replaced):
    loopback up, the Service ClusterIP on it (where the apiserver relay listens) and the
    cluster DNS's address (where CoreDNS listens)."""
    delete_netns(cfg)
    _ip("netns", "add", cfg.netns)
    _ip("-n", cfg.netns, "link", "set", "lo", "up")
    for address in (net.service_ip, net.dns_ip):
        _ip("-n", cfg.netns, "addr", "add", f"{address}/32", "dev", "lo")


def delete_netns(cfg: RealNodeConfig) -> None:
    """Delete the namespace (with the bridge and veth ends in it); no error if absent."""
    if cfg.netns_path.exists():
        subprocess.run(["ip", "netns", "delete", cfg.netns], capture_output=True, check=False)


def in_netns(cfg: RealNodeConfig, argv: Sequence[str]) -> list[str]:
    """`argv` run in the node's network namespace (mounts, cgroups, pids stay shared)."""
    return ["nsenter", f"--net={cfg.netns_path}", *argv]


def pod_network_conflist(cfg: RealNodeConfig, net: PodNetwork) -> dict[str, object]:
    """The CNI network: a bridge that is the pods' gateway, host-local addresses from
    `net.subnet` (state in the node's directory), no masquerade (nothing leaves)."""
    gateway = str(next(ipaddress.ip_network(net.subnet).hosts()))
    return {
        "cniVersion": "0.4.0",
        "name": "kvflow-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net.subnet, "gateway": gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(cfg.cni_dir / "ipam"),
                },
            }
        ],
    }


def write_pod_network(cfg: RealNodeConfig, net: PodNetwork) -> None:
    cfg.cni_dir.mkdir(parents=True, exist_ok=True)
    conflist = pod_network_conflist(cfg, net)
    (cfg.cni_dir / "10-kvflow-pods.conflist").write_text(json.dumps(conflist))


def node_relay_rules(
    cfg: RealNodeConfig, net: PodNetwork, ports: NodePorts, kubeconfig: Path
) -> list[Rule]:
    """Into the namespace: the apiserver, at its loopback port (the kubelet's kubeconfig
    works unchanged) and at the ClusterIP's 443 (pods' in-cluster settings). Out of it:
    the kubelet's port (the apiserver's logs/exec), its health port and CoreDNS's
    readiness port, on root loopback."""
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    api_port = urlsplit(server).port
    if api_port is None:
        raise ValueError(f"no port in the apiserver URL {server}")
    api = Endpoint("127.0.0.1", api_port)
    ns = cfg.netns_path
    return [
        Rule(Endpoint("127.0.0.1", api_port, ns), api),
        Rule(Endpoint(net.service_ip, 443, ns), api),
        Rule(Endpoint("127.0.0.1", ports.kubelet), Endpoint("127.0.0.1", ports.kubelet, ns)),
        *(
            Rule(Endpoint("127.0.0.1", port), Endpoint("127.0.0.1", port, ns))
            for port in (ports.kubelet_healthz, ports.dns_ready)
        ),
    ]


def relay_component(name: str, rules: Sequence[Rule], logs_dir: Path) -> Component:
    """A relay process (`relay.py`) for `rules`, healthy once its listeners are bound."""
    ready = logs_dir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-P", str(_RELAY_SCRIPT), "--ready", str(ready)]
    return Component(
        name, [*argv, *(str(r) for r in rules)], logs_dir / f"{name}.log", ready.exists
    )
