"""Pure pieces between a decision and the cluster: which policy a role runs under, which
pods are read, where the decided size lives (``status.roles.<role>.autoscaling``), the
Event a change posts and the deletion costs a scale-in sets.

The decided size is kept in the ModelDeployment's status, and :func:`decided_sizes` reads
it for rendering (every reconcile: spec change, drift repair, child event) and for the
next decision alike, so the two never fight. Without a decision yet, the role starts at
``replicas`` clamped into its bounds (see :mod:`..sizes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow import contract

from .. import names
from ..sizes import DesiredSizes, desired_sizes
from ..spec import ModelDeployment, WorkerRole
from .collector import PodTarget
from .decision import RUNNING_FILL, Decision, ScalePolicy

__all__ = [
    "DELETION_COST_ANNOTATION",
    "STATUS_KEY",
    "AutoscalerSettings",
    "decided_sizes",
    "deletion_costs",
    "policy_for",
    "ready_targets",
    "role_status",
    "scale_event",
    "status_replicas",
    "without_autoscaling",
]

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
DELETION_COST_SCALE = 1_000_000  # cached-KV fraction -> integer cost
STATUS_KEY = "autoscaling"


@dataclass(frozen=True)
class AutoscalerSettings:
    """Operator-wide timings (``kvflow operator --autoscaler-*``); bounds and targets are
    per role in the ModelDeployment."""

    interval_s: float = 5.0
    latency_window_s: float = 60.0
    stale_s: float = 20.0
    gauge_window_s: float = 10.0
    scale_up_window_s: float = 10.0
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 60.0
    tolerance: float = 0.1
    prometheus_url: str = ""


def policy_for(worker: WorkerRole, settings: AutoscalerSettings) -> ScalePolicy:
    """The decision's policy for one role: its bounds and targets, the operator's timings.
    The running-requests target is 90% of ``maxRunningRequests`` when that is set."""
    a = worker.autoscaling
    running = worker.max_running_requests
    return ScalePolicy(
        role=worker.role,
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        queue_per_replica=a.queue_per_replica,
        kv_usage=a.kv_usage,
        running_per_replica=running * RUNNING_FILL if running else None,
        ttft_s=a.ttft_ms / 1000 if a.ttft_ms else None,
        itl_s=a.itl_ms / 1000 if a.itl_ms else None,
        scale_down_window_s=a.scale_down_stabilization_seconds,
        scale_up_window_s=settings.scale_up_window_s,
        scale_up_cooldown_s=settings.scale_up_cooldown_s,
        scale_down_cooldown_s=settings.scale_down_cooldown_s,
        tolerance=settings.tolerance,
    )


def _role_key(role: str) -> str:
    head, *rest = role.split("-")
    return head + "".join(part.title() for part in rest)


def status_replicas(status: Mapping[str, Any] | None, role: str) -> int | None:
    """The size the autoscaler last decided for ``role``, from the status."""
    roles = (status or {}).get("roles") or {}
    entry = (roles.get(_role_key(role)) or {}).get(STATUS_KEY) or {}
    value = entry.get("desiredReplicas")
    return int(value) if isinstance(value, int) else None


def decided_sizes(md: ModelDeployment, status: Mapping[str, Any] | None) -> DesiredSizes:
    """The sizes to render: each autoscaled role's last decided size (from ``status``),
    clamped into its bounds; the spec's size for the others and before any decision."""
    decided = {}
    for worker in md.workers:
        replicas = status_replicas(status, worker.role)
        if replicas is not None:
            decided[worker.role] = replicas
    return desired_sizes(md, decided)


def without_autoscaling(status: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``status`` without the roles' autoscaling entries: the part the reconciler
    computes and patches. Leaving the entries out of its merge patch (rather than carrying
    them over) means a reconcile that read the object before a decision never writes the
    older entry back."""
    copy = dict(status)
    roles = status.get("roles")
    if isinstance(roles, Mapping):
        copy["roles"] = {
            key: {k: v for k, v in (entry or {}).items() if k != STATUS_KEY}
            for key, entry in roles.items()
        }
    return copy


def role_status(
    decision: Decision,
    current: int,
    ready: int,
    now: str,
    previous: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``status.roles.<role>.autoscaling`` after a decision. ``lastScale`` keeps the last
    change of size (from, to, reason, time); holds do not move it."""
    entry: dict[str, Any] = {
        "desiredReplicas": decision.replicas,
        "currentReplicas": current,
        "readyReplicas": ready,
    }
    if decision.changed:
        entry["lastScale"] = {
            "direction": decision.direction,
            "from": current,
            "to": decision.replicas,
            "reason": decision.reason,
            "time": now,
        }
    elif previous and previous.get("lastScale"):
        entry["lastScale"] = dict(previous["lastScale"])
    return entry


def ready_targets(pods: Sequence[Mapping[str, Any]]) -> list[PodTarget]:
    """Pods that are Ready, not being deleted and have an IP, with their API port (the
    container port named ``http``, else the default)."""
    targets = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
        if not ready:
            continue
        port = contract.DEFAULT_API_PORT
        for container in (pod.get("spec") or {}).get("containers") or ():
            for p in container.get("ports") or ():
                if p.get("name") == contract.API_PORT_NAME:
                    port = int(p["containerPort"])
        targets.append(PodTarget.for_pod_ip(meta["name"], status["podIP"], port))
    return targets


def deletion_costs(cached_kv: Mapping[str, float]) -> dict[str, str]:
    """Pod -> ``pod-deletion-cost`` annotation value: the share of its KV pool held by the
    prefix cache, scaled to an integer, so the ReplicaSet removes the coldest pod first."""
    return {pod: str(round(max(v, 0.0) * DELETION_COST_SCALE)) for pod, v in cached_kv.items()}


def scale_event(
    md: ModelDeployment, role: str, decision: Decision, current: int, now: str
) -> dict[str, Any]:
    """A core/v1 Event on the ModelDeployment for one change of size."""
    reason = "ScaledOut" if decision.direction == "up" else "ScaledIn"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{md.name}.", "namespace": md.namespace},
        "involvedObject": {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "name": md.name,
            "namespace": md.namespace,
            "uid": md.uid,
        },
        "reason": reason,
        "message": f"{role}: {current} -> {decision.replicas}: {decision.reason}",
        "type": "Normal",
        "source": {"component": "kvflow-autoscaler"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
