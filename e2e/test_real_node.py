"""The harness's real node: pods really run there (host networking on loopback, the host
base image with this checkout mounted read-only, the restricted security context), the
apiserver reaches the kubelet for logs and exec, and a node's teardown leaves no process,
mount or cgroup behind."""

from __future__ import annotations

import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.k8s import ControlPlane, Kube
from e2e.k8s.bins import NODE_BINARIES, resolve_binaries
from e2e.k8s.ports import free_ports
from e2e.k8s.realnode import (
    HOST_BASE_IMAGE,
    HostRuntime,
    RealNode,
    missing_capability,
    real_node_placement,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def ns(kube: Kube, real_node: RealNode) -> Iterator[str]:
    name = f"rn-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


def host_pod(ns: str, name: str, port: int, command: list[str]) -> dict[str, Any]:
    host = HostRuntime.current()
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "hostNetwork": True,
            **real_node_placement(),
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": HOST_BASE_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "env": host.env(),
                    "readinessProbe": {
                        "httpGet": {"path": "/", "port": port},
                        "periodSeconds": 1,
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": host.mounts(),
                }
            ],
            "volumes": host.volumes(),
        },
    }


def test_host_pod_runs_kvflow_on_loopback(kube: Kube, ns: str) -> None:
    (port,) = free_ports(1)
    script = (
        "import kvflow.contract, http.server as s; print('kvflow imported', flush=True); "
        f"s.HTTPServer(('127.0.0.1', {port}), s.SimpleHTTPRequestHandler).serve_forever()"
    )
    started = time.monotonic()
    kube.apply(host_pod(ns, "web", port, ["python", "-c", script]))
    kube.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod/web", "--timeout=60s")
    print(f"host pod Ready {time.monotonic() - started:.1f}s after apply")
    pod = kube.get_json("pod", "web", "-n", ns)
    assert pod["spec"]["nodeName"] == "real-node"
    assert pod["status"]["podIP"] == "127.0.0.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
        assert response.status == 200
    # logs and exec go apiserver -> kubelet (InternalIP 127.0.0.1, client certificate)
    assert "kvflow imported" in kube.kubectl("logs", "-n", ns, "web").stdout
    uid = kube.kubectl("exec", "-n", ns, "web", "--", "id", "-u").stdout.strip()
    assert uid == "1000"
    # the root filesystem and the mounted checkout are read-only
    touch = kube.kubectl("exec", "-n", ns, "web", "--", "touch", "/x", check=False)
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr


def test_kwok_only_pods_never_land_on_the_real_node(kube: Kube, ns: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain", "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/none"}]},
    }
    kube.apply(pod)
    kube.wait_for(
        lambda: kube.get_json("pod", "plain", "-n", ns)["spec"].get("nodeName"),
        timeout=30,
        what="the plain pod to be scheduled",
    )
    assert kube.get_json("pod", "plain", "-n", ns)["spec"]["nodeName"].startswith("kwok-node-")


def _leftovers(node: RealNode) -> list[str]:
    state = str(node.config.state_dir.resolve())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state in cmdline:
            found.append(f"process {proc.name}: {cmdline[:200]}")
    with open("/proc/self/mountinfo") as mountinfo:
        found += [f"mount {line.split()[4]}" for line in mountinfo if state in line.split()[4]]
    root = node.config.cgroup_root.lstrip("/")
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/{root}")]
    return found


def test_node_teardown_leaves_nothing(
    control_plane: ControlPlane, kube: Kube, ns: str, tmp_path: Path
) -> None:
    """A second node with a running pod, stopped: its kubelet, containerd, shims and
    containers are gone, nothing is mounted under its state dir, its cgroups are removed,
    containerd's root (images, snapshots) is deleted."""
    if missing_capability() is not None:
        pytest.skip(str(missing_capability()))
    kubelet = resolve_binaries(NODE_BINARIES)["kubelet"]
    node = control_plane.add_real_node(kubelet, name="second-node")
    try:
        (port,) = free_ports(1)
        pod = host_pod(
            ns, "on-second", port, ["python", "-m", "http.server", "-b", "127.0.0.1", str(port)]
        )
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "second-node"}
        kube.apply(pod)
        kube.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod/on-second", "--timeout=60s")
        assert _leftovers(node), "a running node shows its processes and mounts"
        started = time.monotonic()
    finally:
        control_plane.remove_real_node(node)
    print(f"node teardown took {time.monotonic() - started:.1f}s")
    assert _leftovers(node) == []
    assert not os.path.exists(node.config.containerd_socket)
    # its images and snapshots are deleted (GBs per node), its logs kept
    assert not (node.config.containerd_dir / "root").exists()
    assert node.config.logs_dir.is_dir()
