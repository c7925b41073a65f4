"""Pod Security admission: a namespace enforcing the `restricted` standard admits every pod
the operator creates by default, and the chart's operator pod, on the kwok nodes.

Shown by admission itself: the ReplicaSets' pods are created (a refused pod leaves a
`ReplicaFailure` condition naming the violation and no pod). A control pod with host
networking is refused in the same namespace, so the enforcement is known to be on.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.k8s import CommandError, Kube
from e2e.operator_process import OperatorProcess

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kvflow-operator"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
ENFORCE = "pod-security.kubernetes.io/enforce"


@pytest.fixture(scope="module")
def restricted_ns(kube: Kube) -> Iterator[str]:
    name = f"psa-{uuid.uuid4().hex[:8]}"
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "crd/modeldeployments.kvflow.dev")
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "labels": {ENFORCE: "restricted", f"{ENFORCE}-version": "latest"},
            },
        }
    )
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(
    kube: Kube, restricted_ns: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("psa-operator") / "operator.log"
    process = OperatorProcess(kube.env, [restricted_ns], log)
    process.start()
    yield process
    process.stop()


def _refusals(kube: Kube, ns: str) -> list[str]:
    """Messages of ReplicaSets whose pods admission refused."""
    out = []
    for rs in kube.get_json("replicasets", "-n", ns)["items"]:
        for cond in rs.get("status", {}).get("conditions", []):
            if cond["type"] == "ReplicaFailure" and cond["status"] == "True":
                out.append(f"{rs['metadata']['name']}: {cond.get('message')}")
    return out


def _with_router(deployments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``deployments`` once the router's is among them (the operator creates the workers
    first and the router after them), else nothing yet."""
    roles = {d["metadata"]["labels"].get("kvflow.dev/role") for d in deployments}
    return deployments if "router" in roles else []


def _all_pods_created(kube: Kube, ns: str, selector: str) -> list[dict[str, Any]]:
    """The Deployments matching `selector` once each has as many pods as replicas; raises
    at once when admission refused one (no point waiting)."""
    refused = _refusals(kube, ns)
    if refused:
        raise AssertionError("pods refused by admission:\n" + "\n".join(refused))
    deployments = kube.get_json("deployments", "-n", ns, "-l", selector)["items"]
    if not deployments:
        return []
    for deployment in deployments:
        want = deployment["spec"]["replicas"]
        labels = deployment["spec"]["selector"]["matchLabels"]
        match = ",".join(f"{k}={v}" for k, v in labels.items())
        if len(kube.get_json("pods", "-n", ns, "-l", match)["items"]) < want:
            return []
    return list(deployments)


def test_enforcement_is_on(kube: Kube, restricted_ns: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "host-network-control"},
        "spec": {"hostNetwork": True, "containers": [{"name": "c", "image": "example/none"}]},
    }
    with pytest.raises(CommandError) as refused:
        kube.kubectl("apply", "-n", restricted_ns, "--dry-run=server", "-f", "-",
                     input=yaml.safe_dump(pod))  # fmt: skip
    assert 'violates PodSecurity "restricted:latest"' in refused.value.stderr
    assert "host namespaces" in refused.value.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_operator_default_pods_are_admitted(
    kube: Kube, restricted_ns: str, operator: OperatorProcess, example: Path
) -> None:
    (body,) = [d for d in yaml.safe_load_all(example.read_text()) if d["kind"] == "ModelDeployment"]
    name = body["metadata"]["name"]
    kube.kubectl("apply", "-n", restricted_ns, "-f", str(example))
    selector = f"kvflow.dev/deployment={name}"
    deployments = kube.wait_for(
        lambda: _with_router(_all_pods_created(kube, restricted_ns, selector)),
        timeout=90,
        what=f"every pod of {name} to be created",
    )
    roles = {d["metadata"]["labels"].get("kvflow.dev/role") for d in deployments}
    assert "router" in roles and len(roles) >= 2, roles
    pods = kube.get_json("pods", "-n", restricted_ns, "-l", selector)["items"]
    assert pods and all(p["spec"].get("securityContext", {}).get("runAsNonRoot") for p in pods)


def test_chart_operator_pod_is_admitted(kube: Kube, restricted_ns: str) -> None:
    rendered = kube.helm(
        "template", "psa", str(CHART), "--namespace", restricted_ns, "--set", "crds.install=false"
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    # the pod's ServiceAccount with it (a missing one would stop the pod before admission)
    kube.apply([d for d in docs if d["kind"] in ("ServiceAccount", "Deployment")])
    selector = ",".join(
        f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items()
    )
    kube.wait_for(
        lambda: _all_pods_created(kube, restricted_ns, selector),
        timeout=180,  # controller-manager -> ReplicaSet -> pod, slow on a loaded machine
        what="the chart's operator pod to be created",
    )
