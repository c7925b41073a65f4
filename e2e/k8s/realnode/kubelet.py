"""The kubelet of a real node: its configuration file and command line."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..health import http_probe
from ..process import Component
from .config import REAL_NODE_LABEL, NodePorts, RealNodeConfig
from .dns import CLUSTER_DOMAIN
from .podnet import in_netns

__all__ = ["kubelet_component", "write_kubelet_config"]


def write_kubelet_config(cfg: RealNodeConfig, ports: NodePorts, client_ca: Path) -> Path:
    """Write the KubeletConfiguration; return its path.

    Loopback for every listener; cgroupfs driver and cgroup v1 allowed (`failCgroupV1:
    false`); swap tolerated; pods' cgroups under `cfg.cgroup_root`. The apiserver
    authenticates with a client cert signed by `client_ca` (logs/exec); eviction and
    image GC thresholds are set so a full shared disk does not evict test pods.
    """
    kubelet_dir = cfg.kubelet_dir
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": ports.kubelet,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports.kubelet_healthz,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cfg.cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{cfg.containerd_socket}",
        "podLogsDir": str(kubelet_dir / "pod-logs"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        # Pods on the pod network get the cluster DNS and no upstream name servers:
        # nothing may leave the namespace.
        "resolvConf": "/etc/resolv.conf" if cfg.pod_network is None else "",
        **(
            {}
            if cfg.pod_network is None
            else {"clusterDNS": [cfg.pod_network.dns_ip], "clusterDomain": CLUSTER_DOMAIN}
        ),
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # The harness kills every container at teardown; no need to wait for pods.
        "shutdownGracePeriod": "0s",
        "registerWithTaints": [cfg.taint_spec] if cfg.taint else [],
    }
    kubelet_dir.mkdir(parents=True, exist_ok=True)
    cfg.kubelet_config.write_text(yaml.safe_dump(config, sort_keys=False))
    return cfg.kubelet_config


def kubelet_component(
    kubelet: Path, cfg: RealNodeConfig, ports: NodePorts, kubeconfig: Path, client_ca: Path
) -> Component:
    """The kubelet as a component, healthy once its loopback /healthz answers (in
    pod-network mode it runs in the node's namespace; a relay brings /healthz out)."""
    config = write_kubelet_config(cfg, ports, client_ca)
    root = cfg.kubelet_dir
    argv = [
        str(kubelet),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={root / 'root'}",
        f"--cert-dir={root / 'pki'}",
        f"--volume-plugin-dir={root / 'volume-plugins'}",
        f"--hostname-override={cfg.name}",
        "--node-ip=127.0.0.1",
        f"--node-labels={REAL_NODE_LABEL}={cfg.label_value}",
    ]
    return Component(
        "kubelet",
        argv if cfg.pod_network is None else in_netns(cfg, argv),
        cfg.logs_dir / "kubelet.log",
        http_probe(f"http://127.0.0.1:{ports.kubelet_healthz}/healthz"),
    )
