"""The pure pieces between a decision and the cluster (kvflow.operator.autoscale.scale)."""

from __future__ import annotations

from dataclasses import replace

from kvflow.operator import parse_model_deployment, render_children
from kvflow.operator.autoscale import Decision
from kvflow.operator.autoscale.scale import (
    DELETION_COST_ANNOTATION,
    AutoscalerSettings,
    decided_sizes,
    deletion_costs,
    policy_for,
    ready_targets,
    role_status,
    scale_event,
    status_replicas,
    without_autoscaling,
)


def body(autoscaling: dict | None = None, replicas: int = 1) -> dict:
    decode = {"replicas": replicas, "maxRunningRequests": 20}
    if autoscaling:
        decode["autoscaling"] = autoscaling
    return {
        "apiVersion": "kvflow.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 3},
        "spec": {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": decode},
    }


AUTO = {
    "enabled": True,
    "minReplicas": 1,
    "maxReplicas": 5,
    "scaleDownStabilizationSeconds": 120,
    "targets": {"kvUsage": 0.8, "itlMs": 50, "ttftMs": 900, "queuePerReplica": 4},
}


def decode_of(md):
    return next(w for w in md.workers if w.role == "decode")


def test_policy_for_maps_the_crd_targets():
    md = parse_model_deployment(body(AUTO))
    settings = AutoscalerSettings(scale_up_window_s=7, scale_up_cooldown_s=11)
    policy = policy_for(decode_of(md), settings)
    assert (policy.min_replicas, policy.max_replicas) == (1, 5)
    assert (policy.kv_usage, policy.itl_s, policy.ttft_s, policy.queue_per_replica) == (
        0.8,
        0.05,
        0.9,
        4,
    )
    assert policy.running_per_replica == 18.0  # 90% of maxRunningRequests
    assert policy.scale_down_window_s == 120
    assert (policy.scale_up_window_s, policy.scale_up_cooldown_s) == (7, 11)


def deployment_replicas(body: dict, status: dict, role: str) -> int:
    md = parse_model_deployment(body)
    for child in render_children(md, decided_sizes(md, status)):
        if child["kind"] == "Deployment" and child["metadata"]["name"] == f"m-{role}":
            return child["spec"]["replicas"]
    raise AssertionError(role)


def test_rendering_takes_the_decided_size_of_autoscaled_roles_only():
    status = {"roles": {"decode": {"autoscaling": {"desiredReplicas": 4}}}}
    assert deployment_replicas(body(AUTO, replicas=2), status, "decode") == 4
    assert deployment_replicas(body(AUTO, replicas=2), status, "prefill") == 1
    # beyond the bounds (maxReplicas lowered after a decision): clamped by the spec
    status["roles"]["decode"]["autoscaling"]["desiredReplicas"] = 9
    assert deployment_replicas(body(AUTO), status, "decode") == 5
    # autoscaling off: spec.replicas is the one source of truth
    assert deployment_replicas(body(None, replicas=2), status, "decode") == 2
    # no decision yet: replicas clamped into the bounds
    assert deployment_replicas(body(AUTO, replicas=2), {}, "decode") == 2
    assert deployment_replicas(body({**AUTO, "minReplicas": 3}, replicas=2), {}, "decode") == 3
    assert status_replicas({}, "decode") is None
    # without sizes, rendering takes the spec's own (no decision)
    md = parse_model_deployment(body(AUTO, replicas=2))
    deployments = [c for c in render_children(md) if c["kind"] == "Deployment"]
    assert {d["metadata"]["name"]: d["spec"]["replicas"] for d in deployments} == {
        "m-prefill": 1,
        "m-decode": 2,
        "m-router": 1,
    }


def test_status_entry_and_carry_over():
    up = Decision(3, "up", "kv 0.95 vs target 0.8 for 10s: 2 -> 3")
    entry = role_status(up, 2, 2, "2026-01-01T00:00:00Z", None)
    assert entry["desiredReplicas"] == 3 and entry["currentReplicas"] == 2
    assert entry["lastScale"] == {
        "direction": "up",
        "from": 2,
        "to": 3,
        "reason": up.reason,
        "time": "2026-01-01T00:00:00Z",
    }
    hold = Decision(3, "hold", "fits")
    later = role_status(hold, 3, 3, "2026-01-01T00:01:00Z", entry)
    assert later["lastScale"] == entry["lastScale"]
    old = {"roles": {"decode": {"desired": 2, "autoscaling": entry}}, "endpoint": "x"}
    assert without_autoscaling(old) == {"roles": {"decode": {"desired": 2}}, "endpoint": "x"}
    assert old["roles"]["decode"]["autoscaling"] is entry  # the input is left alone
    assert without_autoscaling({}) == {}


def pod(name, ready=True, ip="10.0.0.5", deleting=False, port=8000):
    meta = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_only_ready_pods_with_an_ip_are_read_on_their_http_port():
    pods = [
        pod("a", port=8100),
        pod("b", ready=False),
        pod("c", deleting=True),
        pod("d", ip=""),
        pod("e", ip="fd00::5"),
    ]
    targets = ready_targets(pods)
    assert [(t.name, t.url) for t in targets] == [
        ("a", "http://10.0.0.5:8100"),
        ("e", "http://[fd00::5]:8000"),
    ]


def test_deletion_cost_prefers_removing_the_coldest_cache():
    costs = deletion_costs({"hot": 0.61, "cold": 0.02, "empty": 0.0})
    assert costs == {"hot": "610000", "cold": "20000", "empty": "0"}
    assert DELETION_COST_ANNOTATION == "controller.kubernetes.io/pod-deletion-cost"


def test_scale_event_names_the_model_deployment():
    md = replace(parse_model_deployment(body(AUTO)), uid="u1")
    event = scale_event(md, "decode", Decision(1, "down", "idle"), 2, "2026-01-01T00:00:00Z")
    assert event["involvedObject"]["kind"] == "ModelDeployment"
    assert event["involvedObject"]["uid"] == "u1" and event["reason"] == "ScaledIn"
    assert event["message"] == "decode: 2 -> 1: idle"
