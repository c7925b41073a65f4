"""Command lines and health probes of the control-plane components."""

from __future__ import annotations

from .bins import Binaries
from .certs import FRONT_PROXY_CN, Pki
from .config import ControlPlaneConfig, Ports
from .health import http_probe, insecure_tls, mutual_tls
from .process import Component

__all__ = ["FAKE_NODE_ANNOTATION", "control_plane_components"]

# kwok manages exactly the nodes carrying this annotation (the kwok docs' convention).
FAKE_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")


def control_plane_components(
    bins: Binaries, cfg: ControlPlaneConfig, ports: Ports, pki: Pki
) -> tuple[list[Component], list[Component]]:
    """(storage and API: etcd, kube-apiserver, started in order; the controllers:
    controller-manager, scheduler, kwok, which may start together once the API is up)."""
    log = cfg.logs_dir
    kubeconfig = str(cfg.kubeconfig)
    etcd_url = f"http://127.0.0.1:{ports.etcd_client}"
    peer_url = f"http://127.0.0.1:{ports.etcd_peer}"
    etcd = Component(
        "etcd",
        [
            str(bins["etcd"]),
            "--name=kvflow",
            f"--data-dir={cfg.etcd_dir}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=kvflow={peer_url}",
            # A throwaway test cluster: durability is not worth an fsync per write.
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ],
        log / "etcd.log",
        http_probe(f"{etcd_url}/health"),
    )
    apiserver = Component(
        "kube-apiserver",
        [
            str(bins["kube-apiserver"]),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports.apiserver}",
            f"--tls-cert-file={pki.apiserver_crt}",
            f"--tls-private-key-file={pki.apiserver_key}",
            f"--client-ca-file={pki.ca_crt}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={cfg.service_cidr}",
            # RBAC, so a chart's Roles are really enforced; the admin cert is in
            # system:masters, which RBAC lets do everything.
            "--authorization-mode=RBAC",
            # Front-proxy (aggregation layer) identity; without it every component
            # logs errors about a missing requestheader CA.
            f"--requestheader-client-ca-file={pki.ca_crt}",
            f"--requestheader-allowed-names={FRONT_PROXY_CN}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki.front_proxy_crt}",
            f"--proxy-client-key-file={pki.front_proxy_key}",
            # The advertised address is loopback, which Endpoints may not hold; nothing
            # in the cluster dials the `kubernetes` Service anyway (pods are simulated).
            "--endpoint-reconciler-type=none",
            # A real node (kubelet on loopback) reports no address of its own: the harness
            # sets its InternalIP to 127.0.0.1, and logs/exec go there with this client cert.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={pki.kubelet_client_crt}",
            f"--kubelet-client-key={pki.kubelet_client_key}",
            "--allow-privileged=true",
            "--profiling=false",
        ],
        log / "kube-apiserver.log",
        http_probe(
            f"https://127.0.0.1:{ports.apiserver}/readyz",
            mutual_tls(str(pki.ca_crt), str(pki.admin_crt), str(pki.admin_key)),
        ),
    )
    delegated = [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        # One instance each: leader election would only delay the start.
        "--leader-elect=false",
    ]
    controller_manager = Component(
        "kube-controller-manager",
        [
            str(bins["kube-controller-manager"]),
            *delegated,
            f"--secure-port={ports.controller_manager}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_crt}",
            f"--cluster-signing-cert-file={pki.ca_crt}",
            f"--cluster-signing-key-file={pki.ca_key}",
            f"--service-cluster-ip-range={cfg.service_cidr}",
        ],
        log / "kube-controller-manager.log",
        http_probe(f"https://127.0.0.1:{ports.controller_manager}/healthz", insecure_tls()),
    )
    scheduler = Component(
        "kube-scheduler",
        [str(bins["kube-scheduler"]), *delegated, f"--secure-port={ports.scheduler}"],
        log / "kube-scheduler.log",
        http_probe(f"https://127.0.0.1:{ports.scheduler}/healthz", insecure_tls()),
    )
    key, value = FAKE_NODE_ANNOTATION
    kwok = Component(
        "kwok",
        [
            str(bins["kwok"]),
            f"--kubeconfig={kubeconfig}",
            f"--config={cfg.kwok_config}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={key}={value}",
            f"--cidr={cfg.pod_cidr}",
            "--node-ip=127.0.0.1",
            # Heartbeat through Leases, or the node lifecycle controller marks the
            # nodes NotReady after its grace period.
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{ports.kwok}",
        ],
        log / "kwok.log",
        http_probe(f"http://127.0.0.1:{ports.kwok}/healthz"),
    )
    return [etcd, apiserver], [controller_manager, scheduler, kwok]
