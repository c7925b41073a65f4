"""Status from what the pods report: a crash-looping container makes the ModelDeployment
Degraded with the pod's reason and the container's last words; Ready needs every pod."""

from __future__ import annotations

from typing import Any

from test_operator_status import T0, conditions, deployment

from kvflow.operator import Observation, ServiceReport, WorkloadReport, compute_status
from kvflow.operator.podstatus import PodReport

REFUSED = "kvflow serve: error: --hicache-storage is part of the contract but not implemented"


def pod(
    name: str,
    role: str,
    *,
    ready: bool,
    waiting: str | None = None,
    last_exit: int | None = None,
    running_after_crash: bool = False,
) -> dict[str, Any]:
    """A pod as the kubelet reports it (status written by the kubelet)."""
    container: dict[str, Any] = {"name": "runtime", "ready": ready, "restartCount": 0}
    if waiting:
        container["state"] = {"waiting": {"reason": waiting, "message": "back-off 20s"}}
    else:
        container["state"] = {"running": {"startedAt": T0}}
    if last_exit is not None:
        container["restartCount"] = 3
        container["lastState"] = {
            "terminated": {"exitCode": last_exit, "reason": "Error", "message": REFUSED + "\n"}
        }
    return {
        "metadata": {"name": name, "labels": {"kvflow.dev/role": role}},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [container],
        },
    }


def test_crash_looping_container_is_failing_with_its_last_words() -> None:
    report = PodReport.from_pod(
        pod("m-unified-1", "unified", ready=False, waiting="CrashLoopBackOff", last_exit=2)
    )
    assert report.failing and report.failure_reason == "CrashLoopBackOff"
    assert report.component == "unified" and not report.ready
    assert "exit code 2 (Error)" in report.failure_message and REFUSED in report.failure_message


def test_ready_and_starting_pods_are_not_failing() -> None:
    assert not PodReport.from_pod(pod("a", "unified", ready=True)).failing
    assert not PodReport.from_pod(pod("b", "unified", ready=False)).failing  # loading the model
    # Restarted after a crash and not ready again yet: still failing, says why.
    report = PodReport.from_pod(pod("c", "unified", ready=False, last_exit=137))
    assert (
        report.failure_reason == "ContainerRestarted" and "exit code 137" in report.failure_message
    )
    # An image that cannot be pulled.
    report = PodReport.from_pod(pod("d", "router", ready=False, waiting="ErrImageNeverPull"))
    assert report.failure_reason == "ErrImageNeverPull"


def observe_with_pods(*pods: dict[str, Any], unified_ready: int) -> Observation:
    reports = [
        WorkloadReport.from_deployment(
            deployment("unified", 2, unified_ready, progressing="ReplicaSetUpdated")
        ),
        WorkloadReport.from_deployment(deployment("router", 1, 1)),
    ]
    by_component: dict[str, list[PodReport]] = {}
    for body in pods:
        report = PodReport.from_pod(body)
        by_component.setdefault(report.component, []).append(report)
    return Observation(
        {r.component: r for r in reports}, ServiceReport("m", "ns", 8000), [1], by_component
    )


def test_a_crash_looping_pod_makes_the_deployment_degraded_not_ready() -> None:
    obs = observe_with_pods(
        pod("m-unified-0", "unified", ready=True),
        pod("m-unified-1", "unified", ready=False, waiting="CrashLoopBackOff", last_exit=2),
        pod("m-router-0", "router", ready=True),
        unified_ready=1,
    )
    status = compute_status(1, ["unified", "router"], obs, None, [], T0)
    got = conditions(status)
    assert got["Ready"] == ("False", "ComponentsNotReady")
    assert got["Degraded"] == ("True", "CrashLoopBackOff")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"].startswith("unified pod m-unified-1: CrashLoopBackOff")
    assert REFUSED in degraded["message"]
    assert got["UnifiedReady"] == ("False", "CrashLoopBackOff")
    assert got["RouterReady"] == ("True", "Ready")


def test_pods_still_loading_are_progressing_not_degraded() -> None:
    obs = observe_with_pods(
        pod("m-unified-0", "unified", ready=True),
        pod("m-unified-1", "unified", ready=False),
        unified_ready=1,
    )
    got = conditions(compute_status(1, ["unified", "router"], obs, None, [], T0))
    assert got["Ready"][0] == "False" and got["Degraded"] == ("False", "AsExpected")
    assert got["Progressing"] == ("True", "RollingOut")


def test_every_pod_ready_is_ready() -> None:
    obs = observe_with_pods(
        pod("m-unified-0", "unified", ready=True),
        pod("m-unified-1", "unified", ready=True),
        pod("m-router-0", "router", ready=True),
        unified_ready=2,
    )
    got = conditions(compute_status(1, ["unified", "router"], obs, None, [], T0))
    assert got["Ready"] == ("True", "AllComponentsReady")
    assert got["Degraded"] == ("False", "AsExpected")


def test_only_a_change_of_failure_refreshes_status() -> None:
    from kvflow.operator.handlers import PodFailures

    failures = PodFailures()
    starting = pod("m-unified-1", "unified", ready=False)
    starting["metadata"]["uid"] = "u1"
    crashing = pod("m-unified-1", "unified", ready=False, waiting="CrashLoopBackOff", last_exit=2)
    crashing["metadata"]["uid"] = "u1"
    ready = pod("m-unified-1", "unified", ready=True)
    ready["metadata"]["uid"] = "u1"
    assert not failures.changed(starting, deleted=False)  # never failed: the Deployment says it
    assert not failures.changed(ready, deleted=False)
    assert failures.changed(crashing, deleted=False)
    assert not failures.changed(crashing, deleted=False)  # same failure again
    assert failures.changed(ready, deleted=False)  # recovered
    assert failures.changed(crashing, deleted=False)
    assert failures.changed(crashing, deleted=True)  # a failing pod went away
    assert not failures.changed(ready, deleted=True)


UNSCHEDULABLE = (
    "0/3 nodes are available: 1 Insufficient memory, 2 node(s) didn't match Pod's node "
    "affinity/selector. preemption: 0/3 nodes are available: 3 No preemption victims found."
)


def unschedulable(name: str, role: str) -> dict[str, Any]:
    """A pod the scheduler could not place (status written by the scheduler)."""
    return {
        "metadata": {"name": name, "labels": {"kvflow.dev/role": role}},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": UNSCHEDULABLE,
                }
            ],
        },
    }


def test_an_unschedulable_pod_is_failing_with_the_schedulers_message() -> None:
    report = PodReport.from_pod(unschedulable("m-unified-1", "unified"))
    assert report.failing and report.failure_reason == "Unschedulable"
    assert report.failure_message == UNSCHEDULABLE
    # Scheduled at last (the condition turns True): no longer failing.
    placed = unschedulable("m-unified-1", "unified")
    placed["status"]["conditions"][0].update(status="True", reason="", message="")
    assert not PodReport.from_pod(placed).failing

    obs = observe_with_pods(
        pod("m-unified-0", "unified", ready=True),
        unschedulable("m-unified-1", "unified"),
        pod("m-router-0", "router", ready=True),
        unified_ready=1,
    )
    status = compute_status(1, ["unified", "router"], obs, None, [], T0)
    got = conditions(status)
    assert got["Degraded"] == ("True", "Unschedulable")
    assert got["UnifiedReady"] == ("False", "Unschedulable")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "Insufficient memory" in degraded["message"]
