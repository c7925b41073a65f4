"""The harness's own logic, without starting a cluster: cache bookkeeping, resolution
precedence, certificates, kubeconfig, fake nodes and `wait_for`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.k8s import PINNED, Binaries, K8sEnv, Kube, resolve_binaries
from e2e.k8s.bins import BinCache
from e2e.k8s.certs import make_pki
from e2e.k8s.config import FakeNodeSpec
from e2e.k8s.kubeconfig import write_kubeconfig
from e2e.k8s.nodes import fake_node, node_is_ready


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_staging_modules_follow_the_kubernetes_version() -> None:
    assert PINNED.staging == "v0." + PINNED.kubernetes.split(".", 1)[1]
    assert PINNED.of("kube-apiserver") == PINNED.of("kubectl") == PINNED.kubernetes
    assert PINNED.of("etcd") == PINNED.etcd


def test_cache_serves_a_binary_only_at_its_pinned_version(tmp_path: Path) -> None:
    cache = BinCache(tmp_path, PINNED)
    assert cache.get("kwok") is None
    with cache.staging() as staging:
        installed = cache.install("kwok", _executable(staging / "kwok"))
    assert cache.get("kwok") == installed == cache.bin_dir / "kwok"
    assert not any(p.name.startswith("staging-") for p in cache.root.iterdir())

    bumped = BinCache(tmp_path, type(PINNED)(kwok="9.9.9"))
    assert bumped.get("kwok") is None  # a new pin means a new build
    assert bumped.get("kube-apiserver") is None


def test_explicit_bin_dir_wins_over_the_cache(tmp_path: Path) -> None:
    mine = _executable(tmp_path / "mine" / "kubectl")
    cache = BinCache(tmp_path / "cache", PINNED)
    with cache.staging() as staging:
        cache.install("kubectl", _executable(staging / "kubectl"))
    env = K8sEnv(
        bin_dir=mine.parent,
        cache_dir=tmp_path / "cache",
        download_timeout_s=0,
        go="/nonexistent/go",
        state_dir=tmp_path / "state",
    )
    assert resolve_binaries(["kubectl"], env=env)["kubectl"] == mine
    mine.unlink()  # gone from the explicit dir: the cache's copy is next
    assert resolve_binaries(["kubectl"], env=env)["kubectl"] == cache.bin_dir / "kubectl"


def test_pki_and_kubeconfig_are_consistent(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", "10.96.0.1")
    for cert in (pki.apiserver_crt, pki.admin_crt, pki.front_proxy_crt):
        subprocess.run(
            ["openssl", "verify", "-CAfile", pki.ca_crt, cert], check=True, capture_output=True
        )
    text = subprocess.run(
        ["openssl", "x509", "-in", pki.apiserver_crt, "-noout", "-ext", "subjectAltName"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert "IP Address:127.0.0.1" in text and "IP Address:10.96.0.1" in text
    assert oct(pki.sa_key.stat().st_mode & 0o777) == "0o600"

    config = yaml.safe_load(
        write_kubeconfig(tmp_path / "kc", "https://127.0.0.1:6443", pki).read_text()
    )
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert config["users"][0]["user"]["client-key-data"]


def test_fake_node_readiness_needs_ready_and_no_not_ready_taint() -> None:
    node = fake_node("n0", FakeNodeSpec(), ("kwok.x-k8s.io/node", "fake"))
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert not node_is_ready(node)
    node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    node["spec"]["taints"] = [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]
    assert not node_is_ready(node)
    node["spec"]["taints"] = []
    assert node_is_ready(node)


def test_wait_for_returns_the_value_and_chains_the_last_error(tmp_path: Path) -> None:
    kube = Kube(kubeconfig=tmp_path / "kc", binaries=Binaries(paths={}), env=dict(os.environ))
    calls = iter([None, 0, "done"])
    assert kube.wait_for(lambda: next(calls), timeout=5, interval=0.01) == "done"

    def broken() -> bool:
        raise LookupError("not there yet")

    with pytest.raises(TimeoutError, match="the thing") as timed_out:
        kube.wait_for(broken, timeout=0.05, interval=0.01, what="the thing")
    assert isinstance(timed_out.value.__cause__, LookupError)


def test_lws_pins_its_files_and_its_webhooks_see_only_lws_pods(tmp_path: Path) -> None:
    from e2e.k8s.bins import LWS_BINARIES
    from e2e.k8s.certs import make_serving_cert
    from e2e.k8s.lws import webhook_configurations

    assert {PINNED.of(name) for name in LWS_BINARIES} == {PINNED.lws}
    pki = make_pki(tmp_path / "pki", "10.96.0.1")
    certs = make_serving_cert(pki, "lws-webhook", tmp_path / "certs")
    subprocess.run(
        ["openssl", "verify", "-CAfile", pki.ca_crt, certs / "tls.crt"],
        check=True,
        capture_output=True,
    )
    hooks = [h for c in webhook_configurations(9443, b"pem") for h in c["webhooks"]]
    assert {h["name"] for h in hooks} == {
        "mleaderworkerset.kb.io",
        "mpod.kb.io",
        "vleaderworkerset.kb.io",
        "vpod.kb.io",
    }
    for hook in hooks:
        assert hook["clientConfig"]["url"].startswith("https://127.0.0.1:9443/")
        # a pod without LWS's label never waits on the controller
        pods = hook["rules"][0]["resources"] == ["pods"]
        assert ("objectSelector" in hook) == pods


def test_a_pod_network_node_names_its_dns_to_the_kubelet_and_serves_only_cluster_zones(
    tmp_path: Path,
) -> None:
    from e2e.k8s.config import ControlPlaneConfig
    from e2e.k8s.realnode.config import NodePorts, PodNetwork, RealNodeConfig
    from e2e.k8s.realnode.dns import corefile, kube_dns_service
    from e2e.k8s.realnode.kubelet import write_kubelet_config

    plane = ControlPlaneConfig(state_dir=tmp_path)
    assert PINNED.of("coredns") == f"{PINNED.coredns} (bind cache errors kubernetes log ready)"
    net = PodNetwork(service_ip=plane.service_ip, dns_ip=plane.dns_ip)
    assert (net.service_ip, net.dns_ip) == ("10.96.0.1", "10.96.0.10")
    text = corefile(net, tmp_path / "kubeconfig", 9153)
    zones = "cluster.local in-addr.arpa ip6.arpa"
    assert text.startswith(zones + " {")  # no "." block: other names are refused
    assert f"bind {net.dns_ip}" in text and f"kubernetes {zones} {{" in text
    assert "forward" not in text
    assert kube_dns_service(net)["spec"]["clusterIP"] == net.dns_ip

    ports = NodePorts(10250, 10248, 9153)
    for network, expected in ((net, [net.dns_ip]), (None, None)):
        cfg = RealNodeConfig(tmp_path / f"node-{network is None}", pod_network=network)
        config = yaml.safe_load(write_kubelet_config(cfg, ports, tmp_path / "ca").read_text())
        assert config.get("clusterDNS") == expected
        assert config["resolvConf"] == ("" if network else "/etc/resolv.conf")


def test_a_real_node_refuses_to_start_on_a_disk_without_room_for_its_images(
    tmp_path: Path,
) -> None:
    from e2e.k8s.realnode.node import check_free_space

    check_free_space(tmp_path, need=1)
    with pytest.raises(RuntimeError, match="GiB free for its images"):
        check_free_space(tmp_path, need=2**62)
