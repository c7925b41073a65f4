"""Status is computed from what child Deployments report (their own spec and status)."""

from __future__ import annotations

from typing import Any

from kvflow.operator import Failure, Observation, ServiceReport, WorkloadReport, compute_status
from kvflow.operator.reconcile import status_patch

COMPONENTS = ["prefill", "decode", "router"]
T0, T1 = "2026-11-22T10:00:00Z", "2026-11-22T10:05:00Z"


def deployment(
    role: str,
    replicas: int,
    ready: int,
    *,
    updated: int | None = None,
    generation: int = 1,
    observed: int = 1,
    current: int | None = None,
    progressing: str = "NewReplicaSetAvailable",
) -> dict[str, Any]:
    """A Deployment as the API server returns it, status written by the controller."""
    return {
        "metadata": {
            "name": f"m-{role}",
            "generation": generation,
            "labels": {"kvflow.dev/role": role},
        },
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas if current is None else current,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": ready,
            "conditions": [{"type": "Progressing", "status": "True", "reason": progressing}],
        },
    }


def observe(
    *deployments: dict[str, Any], endpoint: bool = True, generations: tuple[int, ...] = (1,)
) -> Observation:
    reports = {r.component: r for r in map(WorkloadReport.from_deployment, deployments)}
    service = ServiceReport("m", "ns", 8000) if endpoint else None
    return Observation(reports, service, list(generations))


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_ready() -> None:
    obs = observe(
        deployment("prefill", 1, 1), deployment("decode", 2, 2), deployment("router", 1, 1)
    )
    status = compute_status(1, COMPONENTS, obs, None, [], T0)
    assert status["observedGeneration"] == 1
    assert status["endpoint"] == "http://m.ns.svc:8000/v1"
    assert status["roles"]["decode"] == {"desired": 2, "ready": 2, "updated": 2, "summary": "2/2"}
    got = conditions(status)
    assert got["Ready"] == ("True", "AllComponentsReady")
    assert got["Progressing"] == ("False", "RolloutComplete")
    assert got["Degraded"] == ("False", "AsExpected")
    assert got["PrefillReady"] == got["DecodeReady"] == got["RouterReady"] == ("True", "Ready")


def test_rollout_in_progress_is_progressing_not_degraded() -> None:
    obs = observe(
        deployment("prefill", 1, 1),
        deployment(
            "decode",
            2,
            1,
            updated=1,
            current=3,
            generation=2,
            observed=2,
            progressing="ReplicaSetUpdated",
        ),
        deployment("router", 1, 1),
        generations=(2,),
    )
    got = conditions(compute_status(2, COMPONENTS, obs, None, [], T0))
    assert got["Ready"] == ("False", "ComponentsNotReady")
    assert got["Progressing"] == ("True", "RollingOut")
    assert got["Degraded"] == ("False", "AsExpected")
    assert got["DecodeReady"] == ("False", "RollingOut")


def test_controller_not_caught_up_counts_as_rolling_out() -> None:
    obs = observe(
        deployment("prefill", 1, 1, generation=3, observed=2),
        deployment("decode", 1, 1),
        deployment("router", 1, 1),
    )
    got = conditions(compute_status(1, COMPONENTS, obs, None, [], T0))
    assert got["PrefillReady"] == ("False", "RollingOut") and got["Ready"][0] == "False"


def test_lost_pods_after_rollout_are_degraded() -> None:
    obs = observe(
        deployment("prefill", 1, 1), deployment("decode", 2, 1), deployment("router", 1, 1)
    )
    got = conditions(compute_status(1, COMPONENTS, obs, None, [], T0))
    assert got["Degraded"] == ("True", "ReplicasUnavailable")
    assert got["DecodeReady"] == ("False", "Unavailable")
    assert got["Progressing"] == ("False", "RolloutComplete")


def test_missing_child_and_stale_generation() -> None:
    obs = observe(deployment("prefill", 1, 1), deployment("router", 1, 1), generations=(1, 2))
    status = compute_status(2, COMPONENTS, obs, None, [], T0)
    got = conditions(status)
    assert got["DecodeReady"] == ("False", "Missing")
    assert got["Progressing"] == ("True", "RollingOut")
    assert status["observedGeneration"] == 1  # the oldest generation a child was rendered from
    assert "decode" not in status["roles"]


def test_deadline_exceeded_is_a_failed_rollout() -> None:
    failed = deployment("decode", 1, 0, progressing="ProgressDeadlineExceeded")
    failed["status"]["conditions"][0].update(status="False", message="ReplicaSet took too long")
    obs = observe(deployment("prefill", 1, 1), failed, deployment("router", 1, 1))
    status = compute_status(1, COMPONENTS, obs, None, [], T0)
    got = conditions(status)
    assert got["Degraded"] == ("True", "RolloutFailed") and got["DecodeReady"] == (
        "False",
        "Failed",
    )
    decode = next(c for c in status["conditions"] if c["type"] == "DecodeReady")
    assert "took too long" in decode["message"]


def test_permanent_failure_is_a_condition() -> None:
    obs = observe(
        deployment("prefill", 1, 1), deployment("decode", 1, 1), deployment("router", 1, 1)
    )
    failure = Failure("ApplyRejected", "PersistentVolumeClaim is invalid: spec: Forbidden", True)
    status = compute_status(2, COMPONENTS, obs, failure, [], T0)
    got = conditions(status)
    assert got["Degraded"] == ("True", "ApplyRejected") and got["Progressing"] == (
        "False",
        "ApplyRejected",
    )
    assert got["Ready"] == ("True", "AllComponentsReady")  # the previous generation still serves
    assert status["observedGeneration"] == 1
    assert (
        "Forbidden" in next(c for c in status["conditions"] if c["type"] == "Degraded")["message"]
    )


def test_no_endpoint_service_is_not_ready() -> None:
    obs = observe(
        deployment("prefill", 1, 1),
        deployment("decode", 1, 1),
        deployment("router", 1, 1),
        endpoint=False,
    )
    status = compute_status(1, COMPONENTS, obs, None, [], T0)
    assert (
        conditions(status)["Ready"] == ("False", "ComponentsNotReady") and "endpoint" not in status
    )


def test_transition_times_move_only_on_flips() -> None:
    ready = observe(
        deployment("prefill", 1, 1), deployment("decode", 1, 1), deployment("router", 1, 1)
    )
    first = compute_status(1, COMPONENTS, ready, None, [], T0)
    again = compute_status(1, COMPONENTS, ready, None, first["conditions"], T1)
    assert again == first  # nothing changed: no status write needed
    broken = observe(
        deployment("prefill", 1, 1), deployment("decode", 1, 0), deployment("router", 1, 1)
    )
    later = compute_status(1, COMPONENTS, broken, None, first["conditions"], T1)
    times = {c["type"]: c["lastTransitionTime"] for c in later["conditions"]}
    assert times["Ready"] == times["DecodeReady"] == times["Degraded"] == T1
    assert times["PrefillReady"] == times["Progressing"] == T0


def test_status_patch_removes_roles_and_keys_that_went_away() -> None:
    old = {"roles": {"unified": {"ready": 1}}, "externalEndpoint": "http://x", "conditions": []}
    new = {"roles": {"prefill": {"ready": 1}}, "conditions": []}
    patch = status_patch(old, new)
    assert patch["roles"] == {"unified": None, "prefill": {"ready": 1}}
    assert patch["externalEndpoint"] is None
