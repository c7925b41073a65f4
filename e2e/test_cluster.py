"""The harness itself: a real control plane whose controllers, scheduler, admission and
garbage collector work, with kwok nodes that run pods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from e2e.k8s import GPU_RESOURCE, PINNED, CommandError, Kube

pytestmark = pytest.mark.cluster


def test_apiserver_is_ready_at_the_pinned_version(kube: Kube) -> None:
    assert kube.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == f"v{PINNED.kubernetes}"
    assert version["clientVersion"]["gitVersion"] == f"v{PINNED.kubernetes}"


def test_fake_nodes_are_ready_with_gpus(kube: Kube) -> None:
    nodes = kube.get_json("nodes", "-l", "type=kwok")["items"]
    assert len(nodes) == 3
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions["Ready"] == "True"
        assert node["status"]["allocatable"][GPU_RESOURCE] == "8"
        assert node["status"]["capacity"]["cpu"] == "64"


def _deployment(name: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    container = {
        "name": "main",
        "image": "registry.invalid/kvflow/never-pulled:0",  # kwok runs no containers
        "resources": {
            "requests": {"cpu": "1", "memory": "1Gi", GPU_RESOURCE: "1"},
            "limits": {GPU_RESOURCE: "1"},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def test_deployment_pods_are_scheduled_and_ready(kube: Kube, kube_namespace: str) -> None:
    ns = kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_deployment("web", 3)))

    def available() -> bool:
        status = kube.get_json("deployment", "web", "-n", ns).get("status", {})
        return status.get("availableReplicas") == 3

    kube.wait_for(available, timeout=60, what="3 available replicas")
    pods = kube.get_json("pods", "-n", ns, "-l", "app=web")["items"]
    fake_nodes = {n["metadata"]["name"] for n in kube.get_json("nodes")["items"]}
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"]["nodeName"] in fake_nodes
        assert pod["status"]["phase"] == "Running"
        conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert conditions["Ready"] == "True"
        assert pod["status"]["podIP"]

    kube.kubectl("delete", "deployment", "web", "-n", ns, "--wait=false")

    def children_gone() -> bool:
        rs = kube.get_json("replicasets", "-n", ns, "-l", "app=web")["items"]
        left = kube.get_json("pods", "-n", ns, "-l", "app=web")["items"]
        return not rs and not left

    kube.wait_for(children_gone, timeout=60, what="the ReplicaSet and pods to be collected")


_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.e2e.kvflow.dev
spec:
  group: e2e.kvflow.dev
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              minReplicas: {type: integer, minimum: 0}
              maxReplicas: {type: integer, minimum: 0}
            x-kubernetes-validations:
            - rule: self.minReplicas <= self.maxReplicas
              message: minReplicas must not exceed maxReplicas
"""


def _widget(name: str, low: int, high: int) -> str:
    return json.dumps(
        {
            "apiVersion": "e2e.kvflow.dev/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"minReplicas": low, "maxReplicas": high},
        }
    )


def test_crd_cel_rule_rejects_invalid_object(kube: Kube, kube_namespace: str) -> None:
    kube.apply(_CRD)
    kube.kubectl("wait", "--for=condition=Established", "crd/widgets.e2e.kvflow.dev")
    # The discovery cache of a fresh CRD can lag behind Established for a moment.
    kube.wait_for(
        lambda: kube.kubectl("apply", "-n", kube_namespace, "-f", "-", input=_widget("ok", 1, 2)),
        timeout=30,
        what="a valid Widget to be accepted",
    )
    with pytest.raises(CommandError) as rejected:
        kube.kubectl("apply", "-n", kube_namespace, "-f", "-", input=_widget("bad", 3, 1))
    assert "minReplicas must not exceed maxReplicas" in rejected.value.stderr
    missing = kube.kubectl("get", "widget", "bad", "-n", kube_namespace, check=False)
    assert missing.returncode != 0


def test_deleting_owner_collects_owned_object(kube: Kube, kube_namespace: str) -> None:
    ns = kube_namespace
    kube.kubectl("create", "configmap", "owner", "-n", ns, "--from-literal=role=owner")
    owner_uid = kube.get_json("configmap", "owner", "-n", ns)["metadata"]["uid"]
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "namespace": ns,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
            ],
        },
        "data": {"role": "owned"},
    }
    kube.apply(owned)
    kube.kubectl("delete", "configmap", "owner", "-n", ns)

    def owned_gone() -> bool:
        got = kube.kubectl("get", "configmap", "owned", "-n", ns, check=False)
        return got.returncode != 0 and "NotFound" in got.stderr

    kube.wait_for(owned_gone, timeout=60, what="the owned ConfigMap to be garbage-collected")


def test_helm_installs_a_chart(kube: Kube, kube_namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: hello\nversion: 0.1.0\nkubeVersion: '>=1.30.0-0'\n"
    )
    (chart / "values.yaml").write_text("greeting: hi\n")
    (chart / "templates" / "configmap-hello.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    kube.helm("install", "demo", str(chart), "-n", kube_namespace, "--set", "greeting=hello")
    data = kube.get_json("configmap", "demo", "-n", kube_namespace)["data"]
    assert data == {"greeting": "hello"}
    kube.helm("uninstall", "demo", "-n", kube_namespace)
