"""A role over several nodes (``nodesPerReplica``): a LeaderWorkerSet whose groups run one
``kvflow serve --nnodes`` copy, leaders serving HTTP; refusals as the runtime's and the
CRD's; status from the LeaderWorkerSet; a cluster without LWS gets a condition."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_testing import SPECS, load_model_deployment

from kvflow import contract
from kvflow.operator import SpecError, parse_model_deployment, render_children
from kvflow.operator.names import LABEL_NODE
from kvflow.operator.placement import router_selector
from kvflow.operator.reconcile import LWS_UNAVAILABLE, Reconciler
from kvflow.operator.status import WorkloadReport


def _body(**unified: Any) -> dict[str, Any]:
    body = load_model_deployment(SPECS["unified-nodes"])
    body["spec"]["unified"] = {**body["spec"]["unified"], **unified}
    return body


def _by_kind(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    children = render_children(parse_model_deployment(body))
    return [c for c in children if c["kind"] == kind]


def _lws(body: dict[str, Any]) -> dict[str, Any]:
    (lws,) = _by_kind(body, "LeaderWorkerSet")
    return lws


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_a_role_over_nodes_renders_a_leader_worker_set_instead_of_a_deployment() -> None:
    body = _body()
    assert [d["metadata"]["name"] for d in _by_kind(body, "Deployment")] == ["llama-nodes-router"]
    lws = _lws(body)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert (lws["spec"]["replicas"], lws["spec"]["leaderWorkerTemplate"]["size"]) == (2, 2)
    group = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    assert (leader["metadata"]["labels"][LABEL_NODE], worker["metadata"]["labels"][LABEL_NODE]) == (
        "leader",
        "worker",
    )
    # the same command on every node but its rank, which LWS's env gives each pod
    (lead,), (work,) = leader["spec"]["containers"], worker["spec"]["containers"]
    assert lead["command"] == work["command"]
    argv = lead["command"]
    assert (_flag(argv, "--tp-size"), _flag(argv, "--nnodes"), _flag(argv, "--dp-size")) == (
        "16",
        "2",
        None,
    )
    assert _flag(argv, "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert _flag(argv, "--dist-init-addr") == f"$(LWS_LEADER_ADDRESS):{contract.DIST_INIT_PORT}"
    # only the leader serves HTTP: probes, ports and scraping are its
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(lead)
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & set(work)
    assert {p["name"] for p in lead["ports"]} == {"http", "dist-init"}
    assert "prometheus.io/scrape" not in worker["metadata"]["annotations"]
    assert lead["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_cpu_pods_run_one_rank_each() -> None:
    body = _body(gpus=0, nodesPerReplica=3)
    argv = _lws(body)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert (_flag(argv["command"], "--tp-size"), _flag(argv["command"], "--nnodes")) == ("3", "3")
    surge = _lws(body)["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxSurge"]
    assert surge == 1  # no GPU to wait for: CPU groups surge first


@pytest.mark.parametrize("rank", ["0", "1"])
def test_the_runtime_takes_the_rendered_command_on_every_node(rank: str) -> None:
    from kvflow.runtime.server.args import parse_args
    from kvflow.runtime.server.parallel import check_nodes

    lws = _lws(_body(gpus=0))
    argv = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    env = {"LWS_WORKER_INDEX": rank, "LWS_LEADER_ADDRESS": "llama-nodes-unified-0.llama-nodes"}
    expanded = [a.replace("$(LWS_WORKER_INDEX)", env["LWS_WORKER_INDEX"]) for a in argv["command"]]
    expanded = [a.replace("$(LWS_LEADER_ADDRESS)", env["LWS_LEADER_ADDRESS"]) for a in expanded]
    args = parse_args(expanded[2:])
    check_nodes(args.engine, args.role)  # raises on what the runtime refuses
    assert (args.engine.nnodes, args.engine.node_rank, args.engine.tp_size) == (2, int(rank), 2)


def test_services_and_the_router_reach_leaders_only() -> None:
    body = _body()
    headless = next(
        s for s in _by_kind(body, "Service") if s["metadata"]["name"].endswith("-unified")
    )
    assert headless["spec"]["selector"][LABEL_NODE] == "leader"
    assert router_selector(parse_model_deployment(body)).endswith(f",{LABEL_NODE}!=worker")
    # a deployment without such a role keeps its selector as it was
    plain = parse_model_deployment(load_model_deployment(SPECS["unified-tp"]))
    assert LABEL_NODE not in router_selector(plain)
    # the ranks' collectives pick their ports: the role's pods may reach each other on any
    policy = next(
        p for p in _by_kind(body, "NetworkPolicy") if p["metadata"]["name"].endswith("-unified")
    )
    assert any("ports" not in rule for rule in policy["spec"]["ingress"])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tensorParallelSize": 8}, "spec.unified.tensorParallelSize"),  # must be 8 x 2
        ({"gpus": 0, "tensorParallelSize": 2}, "spec.unified.tensorParallelSize"),
        ({"nodesPerReplica": 0}, "spec.unified.nodesPerReplica"),
        (
            {"autoscaling": {"enabled": True, "targets": {"queuePerReplica": 4}}},
            "spec.unified.autoscaling.enabled",
        ),
        ({"ports": {"http": contract.DIST_INIT_PORT}}, "spec.unified.nodesPerReplica"),
    ],
)
def test_what_a_role_over_nodes_refuses(change: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_model_deployment(_body(**change))
    assert refused.value.field_path == field


def test_tensor_parallel_size_over_nodes_is_every_gpu_of_the_group() -> None:
    worker = parse_model_deployment(_body(tensorParallelSize=16)).workers[0]
    assert (worker.tp_size, worker.dp_size) == (16, 1)


def test_prefill_and_decode_do_not_span_nodes() -> None:
    body = load_model_deployment(SPECS["disaggregated-tp"])
    body["spec"]["decode"] = {**body["spec"]["decode"], "nodesPerReplica": 2}
    with pytest.raises(SpecError, match="only the unified role spans nodes") as refused:
        parse_model_deployment(body)
    assert refused.value.field_path == "spec.decode.nodesPerReplica"


def test_long_names_are_refused_over_nodes() -> None:
    body = _body()
    body["metadata"]["name"] = "m" * 39
    with pytest.raises(SpecError) as refused:
        parse_model_deployment(body)
    assert refused.value.field_path == "metadata.name"


def test_status_counts_groups_of_the_leader_worker_set() -> None:
    lws = copy.deepcopy(_lws(_body()))
    lws["metadata"]["generation"] = 3
    lws["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    lws["status"]["conditions"] = [
        {"type": "Available", "status": "True"},
        {"type": "UpdateInProgress", "status": "False"},
    ]
    report = WorkloadReport.from_leader_worker_set(lws)
    assert (report.component, report.desired, report.ready, report.state) == (
        "unified",
        2,
        1,
        "Unavailable",
    )
    lws["status"]["readyReplicas"] = 2
    assert WorkloadReport.from_leader_worker_set(lws).state == "Ready"
    lws["status"]["updatedReplicas"] = 1  # a group still on the old templates
    assert WorkloadReport.from_leader_worker_set(lws).state == "RollingOut"


class NoLwsCluster:
    """One reconcile's calls against a cluster that does not serve LeaderWorkerSets."""

    def __init__(self, body: dict[str, Any], serves_lws: bool) -> None:
        self.body = {**body, "metadata": {**body["metadata"], "uid": "u", "generation": 1}}
        self.serves_lws = serves_lws
        self.applied: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {}

    def get_model_deployment(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.body)

    def serves(self, api_version: str, kind: str) -> bool:
        return self.serves_lws

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(manifest)
        return manifest

    def list_objects(self, *args: Any) -> list[dict[str, Any]]:
        return []

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.status.update(patch)


@pytest.mark.parametrize("serves_lws", [False, True])
def test_without_the_lws_api_the_spec_is_refused_as_a_condition(serves_lws: bool) -> None:
    cluster = NoLwsCluster(_body(), serves_lws)
    Reconciler(cluster, clock=lambda: "2026-11-29T00:00:00Z").reconcile(  # type: ignore[arg-type]
        "models", "llama-nodes"
    )
    degraded = {c["type"]: c for c in cluster.status["conditions"]}["Degraded"]
    if serves_lws:
        assert "LeaderWorkerSet" in {c["kind"] for c in cluster.applied}
        assert degraded["reason"] != LWS_UNAVAILABLE
        return
    assert cluster.applied == []  # nothing: a Deployment of half-groups would never serve
    assert (degraded["status"], degraded["reason"]) == ("True", LWS_UNAVAILABLE)
    assert "spec.unified.nodesPerReplica" in degraded["message"]
