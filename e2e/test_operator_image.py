"""The operator image built here (no registry, no daemon: `e2e.k8s.realnode.operator_image`,
the steps of images/operator.Dockerfile on a Debian root) runs as the chart's operator pod
on the real node, with nothing from the host mounted, and reconciles the unchanged unified
example (its pods land on the kwok nodes) to Ready."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.chart_release import install_operator_chart
from e2e.k8s import Kube
from e2e.k8s.ports import free_ports
from e2e.k8s.realnode import RealNode, api_server_env, real_node_placement
from e2e.k8s.realnode.operator_image import (
    build_operator_image,
    ensure_operator_base,
    image_builder_missing,
)

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "unified-embedded.yaml"


@pytest.fixture(scope="module")
def operator_image(real_node: RealNode) -> str:
    reason = image_builder_missing()
    if reason is not None:
        pytest.skip(f"cannot build the operator image here: {reason}")
    started = time.monotonic()
    image = build_operator_image(real_node.config, REPO, ensure_operator_base(REPO))
    print(f"operator image built and imported in {time.monotonic() - started:.1f}s")
    return image


@pytest.fixture(scope="module")
def md_ns(kube: Kube) -> Iterator[str]:
    name = f"img-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def release(
    kube: Kube, md_ns: str, operator_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    namespace, name = f"kvflow-img-{uuid.uuid4().hex[:6]}", "kvflow-img"
    repository, tag = operator_image.rsplit(":", 1)
    (health_port,) = free_ports(1)
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "watchNamespaces": [md_ns],
        "hostNetwork": True,
        "health": {"host": "127.0.0.1", "port": health_port},
        "env": api_server_env(kube.kubeconfig),
        **real_node_placement(),
    }
    seconds = install_operator_chart(
        kube, name, namespace, values, tmp_path_factory.mktemp("image-values")
    )
    print(f"helm install with the built image (operator pod running): {seconds:.1f}s")
    yield {"namespace": namespace, "name": name}
    kube.helm("uninstall", name, "-n", namespace, "--wait", check=False)
    kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_built_operator_image_reconciles_the_example(
    kube: Kube, md_ns: str, release: dict[str, Any]
) -> None:
    (pod,) = kube.get_json(
        "pods", "-n", release["namespace"], "-l", f"app.kubernetes.io/instance={release['name']}"
    )["items"]
    assert pod["spec"]["nodeName"] == "real-node"
    (container,) = pod["spec"]["containers"]
    assert container["image"].startswith("localhost/kvflow/operator:")
    assert not [v for v in pod["spec"]["volumes"] if "hostPath" in v]
    started = time.monotonic()
    kube.kubectl("apply", "-n", md_ns, "-f", str(EXAMPLE))
    (body,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "ModelDeployment"]
    name = body["metadata"]["name"]

    def ready() -> bool:
        status = kube.get_json("md", name, "-n", md_ns).get("status", {})
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
        )

    try:
        kube.wait_for(ready, timeout=120, what=f"{name} Ready")
    except TimeoutError as err:
        logs = kube.kubectl(
            "logs", "-n", release["namespace"], pod["metadata"]["name"], "--tail=40", check=False
        )
        raise AssertionError(f"{err}; operator log:\n{logs.stdout}{logs.stderr}") from err
    print(f"apply -> Ready with the built operator image: {time.monotonic() - started:.1f}s")
    pods = kube.get_json("pods", "-n", md_ns, "-l", f"kvflow.dev/deployment={name}")["items"]
    assert pods and all(p["spec"]["nodeName"].startswith("kwok-node-") for p in pods)
