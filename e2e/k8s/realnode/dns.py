"""Cluster DNS of a pod-network node: CoreDNS in the node's namespace, answering for
`cluster.local` from the API server (Services, headless Services' pods, pod names).

What a cluster's `kube-dns` does for its pods, without the Deployment: CoreDNS runs as a
harness process inside the node's network namespace, bound to `PodNetwork.dns_ip` (an
address on the namespace's loopback, reached by the pods through their gateway), and
reads the API through the kubelet's kubeconfig (the apiserver is relayed into the
namespace at the same loopback port). The kubelet names it as `clusterDNS`, so every pod
with the default `dnsPolicy: ClusterFirst` resolves `<svc>.<ns>`,
`<pod-hostname>.<subdomain>.<ns>` (LeaderWorkerSet's `LWS_LEADER_ADDRESS`) and the like.
Nothing is forwarded upstream: other names are refused (REFUSED) at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..health import http_probe
from ..process import Component
from .config import PodNetwork, RealNodeConfig
from .podnet import in_netns

__all__ = ["CLUSTER_DOMAIN", "coredns_component", "corefile", "kube_dns_service"]

CLUSTER_DOMAIN = "cluster.local"


def corefile(net: PodNetwork, kubeconfig: Path, ready_port: int) -> str:
    """The Corefile: the cluster zone and reverse zones from the API (pod A records by
    name, `pods insecure` as kubeadm's default), readiness on the namespace's loopback.
    Only those zones are served: a query for any other name is refused."""
    zones = f"{CLUSTER_DOMAIN} in-addr.arpa ip6.arpa"
    return (
        f"{zones} {{\n"
        f"    bind {net.dns_ip}\n"
        "    errors\n"
        "    log\n"
        f"    ready 127.0.0.1:{ready_port}\n"
        f"    kubernetes {zones} {{\n"
        f"        kubeconfig {kubeconfig}\n"
        "        pods insecure\n"
        "        ttl 5\n"
        "    }\n"
        "    cache 5\n"
        "}\n"
    )


def coredns_component(
    coredns: Path, cfg: RealNodeConfig, kubeconfig: Path, ready_port: int
) -> Component:
    """CoreDNS in the node's namespace; healthy once its `ready` endpoint (relayed to
    root loopback at the same port) says the Kubernetes plugin has synced."""
    net = cfg.pod_network
    if net is None:
        raise ValueError(f"{cfg.name} has no pod network: its pods use the host's DNS")
    config = cfg.state_dir / "coredns" / "Corefile"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(corefile(net, kubeconfig, ready_port))
    return Component(
        "coredns",
        in_netns(cfg, [str(coredns), "-conf", str(config)]),
        cfg.logs_dir / "coredns.log",
        http_probe(f"http://127.0.0.1:{ready_port}/ready"),
    )


def kube_dns_service(net: PodNetwork) -> dict[str, Any]:
    """`kube-system/kube-dns` holding `dns_ip` as its ClusterIP, as in a kubeadm cluster:
    the address is reserved (no Service is given it) and named where users look for it.
    It selects nothing; CoreDNS is the harness's process, not a pod."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "kube-dns",
            "namespace": "kube-system",
            "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"},
        },
        "spec": {
            "clusterIP": net.dns_ip,
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            ],
        },
    }
