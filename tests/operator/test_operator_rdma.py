"""``kvTransfer.protocol: rdma`` is refused, as a status condition, while no node
advertises an RDMA resource; with one, the deployment renders as before."""

from __future__ import annotations

import copy
from typing import Any

from operator_testing import SPECS, load_model_deployment

from kvflow.operator import parse_model_deployment
from kvflow.operator.rdma import RDMA_UNAVAILABLE, is_rdma_resource, rdma_resources, uses_rdma
from kvflow.operator.reconcile import Reconciler


def node(name: str, **allocatable: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"allocatable": allocatable}}


class FakeCluster:
    """The calls one reconcile makes, against an empty namespace and a set of nodes."""

    def __init__(self, body: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
        self.body = {**body, "metadata": {**body["metadata"], "uid": "u", "generation": 1}}
        self.nodes = nodes
        self.applied: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {}
        self.node_listings = 0

    def get_model_deployment(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.body)

    def list_nodes(self) -> list[dict[str, Any]]:
        self.node_listings += 1
        return self.nodes

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(manifest)
        return manifest

    def create_if_absent(self, manifest: dict[str, Any]) -> bool:
        return True

    def list_objects(self, *args: Any) -> list[dict[str, Any]]:
        return []

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.status.update(patch)


def reconcile(spec: str, nodes: list[dict[str, Any]]) -> FakeCluster:
    body = load_model_deployment(SPECS[spec])
    body["metadata"].setdefault("namespace", "ns")
    cluster = FakeCluster(body, nodes)
    Reconciler(cluster, clock=lambda: "2026-11-23T00:00:00Z").reconcile(  # type: ignore[arg-type]
        "ns", body["metadata"]["name"]
    )
    return cluster


def test_rdma_resource_names() -> None:
    assert is_rdma_resource("rdma/hca_shared_devices_a")
    assert is_rdma_resource("example.com/rdma_shared_device_a")
    assert not is_rdma_resource("nvidia.com/gpu") and not is_rdma_resource("rdma")
    nodes = [node("a", **{"rdma/hca": "0", "nvidia.com/gpu": "8"}), node("b", **{"rdma/hca": "1k"})]
    assert rdma_resources(nodes) == ["b/rdma/hca"]


def test_which_specs_use_rdma() -> None:
    uses = {
        n: uses_rdma(parse_model_deployment(load_model_deployment(p))) for n, p in SPECS.items()
    }
    assert uses == {n: n in ("disaggregated-pvc", "disaggregated-tp") for n in SPECS}


def test_rdma_without_a_device_is_refused_as_a_condition() -> None:
    cluster = reconcile("disaggregated-pvc", [node("gpu-0", **{"nvidia.com/gpu": "8"})])
    assert cluster.applied == []  # nothing rendered: pods could not move KV anywhere
    degraded = {c["type"]: c for c in cluster.status["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", RDMA_UNAVAILABLE)
    assert "spec.kvTransfer.protocol" in degraded["message"]


def test_rdma_with_a_device_renders() -> None:
    cluster = reconcile("disaggregated-pvc", [node("gpu-0", **{"rdma/hca_shared_devices_a": "1"})])
    assert cluster.applied and cluster.node_listings == 1
    degraded = {c["type"]: c for c in cluster.status["conditions"]}["Degraded"]
    assert degraded["reason"] != RDMA_UNAVAILABLE


def test_tcp_specs_do_not_list_nodes() -> None:
    cluster = reconcile("disaggregated-hicache", [])
    assert cluster.applied and cluster.node_listings == 0
