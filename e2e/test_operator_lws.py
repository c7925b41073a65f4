"""A unified role over two nodes (``nodesPerReplica: 2``) on the real control plane.

Without LeaderWorkerSet installed, the operator applies nothing and says why in a
condition; once LWS's controller runs (the ``lws`` fixture: built from sigs.k8s.io/lws at
the pinned version, its CRD and webhooks installed), the operator's drift sweep applies the
LeaderWorkerSet and LWS makes every group's leader and worker pods (kwok runs them), each
with LWS's env and the operator's ``kvflow serve --nnodes`` command. The operator runs as a
process, as in test_operator.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.k8s import Kube
from e2e.k8s.lws import LWS_CRD_NAME, LwsController
from e2e.operator_process import OperatorProcess
from e2e.test_operator import condition, crds_and_namespace, wait_body, wait_ready
from kvflow import contract
from kvflow.operator.reconcile import LWS_UNAVAILABLE

pytestmark = pytest.mark.cluster

NAME = "lws"
GROUPS, NODES, GPUS = 2, 2, 4  # 4 pods of 4 GPUs: 16 of the kwok nodes' 24
BODY: dict[str, Any] = {
    "apiVersion": "kvflow.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": NAME},
    "spec": {"unified": {"replicas": GROUPS, "gpus": GPUS, "nodesPerReplica": NODES}},
}


@pytest.fixture(scope="module")
def ns(kube: Kube) -> Iterator[str]:
    yield from crds_and_namespace(kube, "lws")


@pytest.fixture(scope="module")
def operator(
    kube: Kube, ns: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(kube.env, [ns], log, drift_interval=2.0)
    process.start()
    yield process
    process.stop()


def _unified_pods(kube: Kube, ns: str) -> list[dict[str, Any]]:
    selector = f"kvflow.dev/deployment={NAME},kvflow.dev/role=unified"
    items = kube.get_json("pods", "-n", ns, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _env(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container.get("env") or ()}


def test_without_lws_the_role_is_refused_as_a_condition(
    kube: Kube, ns: str, operator: OperatorProcess
) -> None:
    installed = kube.kubectl("get", "crd", LWS_CRD_NAME, check=False).returncode == 0
    assert not installed, (
        "LeaderWorkerSet is installed in this session's cluster already: this test must run "
        "before the `lws` fixture installs it (keep it first in this module)"
    )
    kube.apply({**BODY, "metadata": {**BODY["metadata"], "namespace": ns}})

    def refused() -> dict[str, Any] | None:
        body = kube.get_json("modeldeployment", NAME, "-n", ns)
        degraded = condition(body, "Degraded")
        return body if degraded.get("reason") == LWS_UNAVAILABLE else None

    body = wait_body(kube, refused, 30, "Degraded/LeaderWorkerSetUnavailable")
    assert "spec.unified.nodesPerReplica" in condition(body, "Degraded")["message"]
    assert condition(body, "Ready")["status"] == "False"
    assert _unified_pods(kube, ns) == []  # nothing applied, not even a Deployment
    assert "Traceback" not in operator.log()


def test_lws_makes_each_groups_leader_and_worker_pods(
    kube: Kube, ns: str, operator: OperatorProcess, lws: LwsController
) -> None:
    started = time.monotonic()
    kube.apply({**BODY, "metadata": {**BODY["metadata"], "namespace": ns}})  # no-op if there
    body = wait_ready(kube, ns, NAME, timeout=120)  # the drift sweep applies it now
    print(f"LWS installed to ModelDeployment Ready: {time.monotonic() - started:.1f}s")
    assert body["status"]["roles"]["unified"]["summary"] == f"{GROUPS}/{GROUPS}"

    lws_name = f"{NAME}-unified"
    workload = kube.get_json("leaderworkerset", lws_name, "-n", ns)
    assert workload["spec"]["leaderWorkerTemplate"]["size"] == NODES
    assert workload["status"]["readyReplicas"] == GROUPS
    assert kube.get_json("deployments", "-n", ns, "-l", "kvflow.dev/role=unified")["items"] == []

    pods = _unified_pods(kube, ns)
    assert len(pods) == GROUPS * NODES
    leaders = []
    for pod in pods:
        labels, env = pod["metadata"]["labels"], _env(pod)
        group = labels["leaderworkerset.sigs.k8s.io/group-index"]
        index = labels["leaderworkerset.sigs.k8s.io/worker-index"]
        leader = f"{lws_name}-{group}"
        # LWS's webhook gave the pod its place; the operator's command reads it
        assert env["LWS_WORKER_INDEX"] == index and env["LWS_GROUP_SIZE"] == str(NODES)
        assert env["LWS_LEADER_ADDRESS"] == f"{leader}.{leader}.{ns}"
        assert labels["kvflow.dev/node"] == ("leader" if index == "0" else "worker")
        (container,) = pod["spec"]["containers"]
        argv = container["command"]
        assert argv[argv.index("--tp-size") + 1] == str(GPUS * NODES)
        assert argv[argv.index("--nnodes") + 1] == str(NODES)
        assert argv[argv.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        addr = f"$(LWS_LEADER_ADDRESS):{contract.DIST_INIT_PORT}"
        assert argv[argv.index("--dist-init-addr") + 1] == addr
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(GPUS)
        assert ("readinessProbe" in container) == (index == "0")  # only leaders serve HTTP
        assert pod["status"]["phase"] == "Running" and pod["spec"]["nodeName"]
        if index == "0":
            leaders.append(pod["metadata"]["name"])
    assert sorted(leaders) == [f"{lws_name}-{g}" for g in range(GROUPS)]

    # The role's Service selects leaders only (kwok's loopback pod IPs keep Services
    # without endpoints, so the selector is checked against the pods).
    service = kube.get_json("service", lws_name, "-n", ns)
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    selected = kube.get_json("pods", "-n", ns, "-l", selector)["items"]
    assert sorted(p["metadata"]["name"] for p in selected) == sorted(leaders)


def test_deleting_the_model_deployment_removes_the_groups(
    kube: Kube, ns: str, lws: LwsController
) -> None:
    kube.kubectl("delete", "modeldeployment", NAME, "-n", ns, "--wait=false")
    kube.wait_for(
        lambda: not kube.get_json("leaderworkersets", "-n", ns)["items"],
        60,
        0.5,
        "the LeaderWorkerSet garbage-collected",
    )
    kube.wait_for(lambda: not _unified_pods(kube, ns), 60, 0.5, "the group pods gone")
