"""ModelDeployment status, computed only from what the child objects report.

Input is an :class:`Observation` (the child Deployments' own status, the router Service,
the generation annotation every child carries) plus the outcome of the last apply; output
is the ``status`` document. Nothing here reads the spec's replica counts: a role's
``desired`` is its Deployment's ``spec.replicas``, ``ready`` its ``status.readyReplicas``.

Component states, from one Deployment's report::

    Missing     no Deployment (deleted, or not created yet)
    Failed      progress deadline exceeded, or a ReplicaFailure condition
    RollingOut  controller has not caught up, new pods not all updated/ready, old pods left
    Unavailable rollout finished but fewer pods ready than desired (pods lost readiness)
    Ready       ready >= desired

The pods add what the Deployments cannot say (:mod:`.podstatus`): a pod whose container
crash-loops or cannot start is failing, with the kubelet's reason and the container's last
words. A worker pod is Ready once its readiness probe (``/health``, which answers only once
the model is loaded) passes; the router pod once its ``/readiness`` does, which is the
router's own report that it has a healthy worker of every role.

Conditions: ``Ready`` (every component Ready and the endpoint Service exists),
``Progressing`` (something is rolling out or missing, or the spec is not applied yet),
``Degraded`` (apply failed, a pod is failing (reason: the pod's, e.g. ``CrashLoopBackOff``),
or a component is Failed/Unavailable), and ``<Component>Ready`` per component.
``lastTransitionTime`` only moves when a condition's status flips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import names
from .podstatus import PodReport

NEW_RS_AVAILABLE = "NewReplicaSetAvailable"  # Deployment controller: rollout complete
MAX_PODS_NAMED = 3  # failing pods quoted in one condition message


@dataclass(frozen=True)
class WorkloadReport:
    """What one child Deployment (or LeaderWorkerSet) reports about itself."""

    component: str
    desired: int
    ready: int
    updated: int
    current: int
    generation: int
    observed_generation: int
    rollout_complete: bool
    failure: str | None

    @classmethod
    def from_deployment(cls, obj: Mapping[str, Any]) -> WorkloadReport:
        meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or ()}
        progressing = conditions.get("Progressing", {})
        failure = None
        if progressing.get("reason") == "ProgressDeadlineExceeded":
            failure = progressing.get("message") or "progress deadline exceeded"
        elif conditions.get("ReplicaFailure", {}).get("status") == "True":
            failure = conditions["ReplicaFailure"].get("message") or "replica failure"
        return cls(
            component=str(meta["labels"][names.LABEL_ROLE]),
            desired=int(spec.get("replicas", 1)),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            current=int(status.get("replicas") or 0),
            generation=int(meta.get("generation") or 0),
            observed_generation=int(status.get("observedGeneration") or 0),
            rollout_complete=progressing.get("reason") == NEW_RS_AVAILABLE,
            failure=failure,
        )

    @classmethod
    def from_leader_worker_set(cls, obj: Mapping[str, Any]) -> WorkloadReport:
        """A LeaderWorkerSet's report, counted in groups (one replica is one group).

        LWS v0.7 reports no observedGeneration (nor sets it in its conditions) and has no
        progress deadline: its ``updatedReplicas`` (groups on the current templates) stands
        for catching up, and nothing counts as Failed (a failing pod still shows through
        the pods, see :mod:`.podstatus`).
        """
        meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or ()}
        generation = int(meta.get("generation") or 0)
        updating = conditions.get("UpdateInProgress", {}).get("status") == "True"
        available = conditions.get("Available", {}).get("status") == "True"
        return cls(
            component=str(meta["labels"][names.LABEL_ROLE]),
            desired=int(spec.get("replicas", 1)),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            current=int(status.get("replicas") or 0),
            generation=generation,
            observed_generation=generation,
            rollout_complete=available and not updating,
            failure=None,
        )

    @property
    def state(self) -> str:
        """One of the component states in the module docstring."""
        if self.failure:
            return "Failed"
        caught_up = self.observed_generation >= self.generation
        settled = caught_up and self.updated >= self.desired and self.current <= self.desired
        if settled and self.ready >= self.desired:
            return "Ready"
        if not settled or not self.rollout_complete:
            return "RollingOut"
        return "Unavailable"


@dataclass(frozen=True)
class ServiceReport:
    """The router Service as it exists: where clients reach the API."""

    name: str
    namespace: str
    port: int
    external_host: str | None = None

    @classmethod
    def from_service(cls, obj: Mapping[str, Any]) -> ServiceReport:
        ports = obj.get("spec", {}).get("ports") or [{}]
        ingress = (obj.get("status", {}).get("loadBalancer") or {}).get("ingress") or []
        host = (ingress[0].get("hostname") or ingress[0].get("ip")) if ingress else None
        return cls(
            obj["metadata"]["name"],
            obj["metadata"]["namespace"],
            int(ports[0].get("port", 0)),
            host,
        )


@dataclass(frozen=True)
class Observation:
    """Children of one ModelDeployment, as listed from the API server."""

    workloads: Mapping[str, WorkloadReport]
    endpoint: ServiceReport | None
    rendered_generations: Sequence[int]  # the kvflow.dev/generation annotation of each child
    pods: Mapping[str, Sequence[PodReport]] = field(default_factory=dict)  # by component
    # role -> {adapter: "loaded/ready"} as the router reports (lora_status.py); absent:
    # no spec.lora, or no router answered
    lora_adapters: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def failing(self, component: str) -> list[PodReport]:
        """The component's failing pods, by name."""
        return sorted((p for p in self.pods.get(component, ()) if p.failing), key=lambda p: p.name)


@dataclass(frozen=True)
class Failure:
    """Why the last reconcile could not apply the spec."""

    reason: str
    message: str
    permanent: bool


def status_key(component: str) -> str:
    """``mooncake-master`` -> ``mooncakeMaster`` (the key under ``status.roles``)."""
    head, *rest = component.split("-")
    return head + "".join(part.title() for part in rest)


def condition_type(component: str) -> str:
    """``mooncake-master`` -> ``MooncakeMasterReady``."""
    key = status_key(component)
    return key[0].upper() + key[1:] + "Ready"


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }


def _component_condition(
    component: str, report: WorkloadReport | None, failing: Sequence[PodReport]
) -> dict[str, Any]:
    if report is None:
        return _condition(condition_type(component), False, "Missing", "no Deployment found")
    message = f"{report.ready}/{report.desired} ready, {report.updated} updated"
    if report.failure:
        message += f": {report.failure}"
    reason = report.state
    if failing and report.state != "Ready":
        reason = str(failing[0].failure_reason)
        message += "; " + "; ".join(p.describe() for p in failing[:MAX_PODS_NAMED])
    return _condition(condition_type(component), report.state == "Ready", reason, message)


def compute_status(
    generation: int,
    components: Sequence[str],
    observation: Observation,
    failure: Failure | None,
    previous_conditions: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The ``status`` document for a ModelDeployment at ``generation``."""
    reports = observation.workloads
    states = {c: (reports[c].state if c in reports else "Missing") for c in components}
    not_ready = [f"{c} {states[c]}" for c in components if states[c] != "Ready"]
    observed = min(observation.rendered_generations, default=None)

    ready_ok = not not_ready and observation.endpoint is not None
    ready_msg = (
        "all components ready" if ready_ok else "; ".join(not_ready or ["no endpoint Service"])
    )
    ready = _condition(
        "Ready", ready_ok, "AllComponentsReady" if ready_ok else "ComponentsNotReady", ready_msg
    )

    moving = [c for c in components if states[c] in ("RollingOut", "Missing")]
    if failure is not None:
        progressing = _condition("Progressing", False, failure.reason, failure.message)
    elif moving or observed != generation:
        detail = ", ".join(moving) or f"generation {generation} not applied to every child yet"
        progressing = _condition("Progressing", True, "RollingOut", f"rolling out: {detail}")
    else:
        progressing = _condition(
            "Progressing", False, "RolloutComplete", f"generation {generation} rolled out"
        )

    broken = [c for c in components if states[c] in ("Failed", "Unavailable")]
    failing = [
        (c, pod) for c in components if states[c] != "Ready" for pod in observation.failing(c)
    ]
    if failure is not None:
        degraded = _condition("Degraded", True, failure.reason, failure.message)
    elif failing:
        degraded = _condition(
            "Degraded",
            True,
            str(failing[0][1].failure_reason),
            "; ".join(f"{c} {pod.describe()}" for c, pod in failing[:MAX_PODS_NAMED]),
        )
    elif broken:
        reason = (
            "RolloutFailed" if any(states[c] == "Failed" for c in broken) else "ReplicasUnavailable"
        )
        degraded = _condition(
            "Degraded", True, reason, "; ".join(f"{c} {states[c]}" for c in broken)
        )
    else:
        degraded = _condition("Degraded", False, "AsExpected", "no failures reported")

    conditions = [ready, progressing, degraded]
    conditions += [
        _component_condition(c, reports.get(c), observation.failing(c)) for c in components
    ]
    previous = {c.get("type"): c for c in previous_conditions}
    for condition in conditions:
        before = previous.get(condition["type"])
        same = before is not None and before.get("status") == condition["status"]
        condition["lastTransitionTime"] = (
            before.get("lastTransitionTime", now) if same and before else now
        )
        if observed is not None:
            condition["observedGeneration"] = observed

    roles: dict[str, Any] = {
        status_key(c): {
            "desired": reports[c].desired,
            "ready": reports[c].ready,
            "updated": reports[c].updated,
            "summary": f"{reports[c].ready}/{reports[c].desired}",
        }
        for c in components
        if c in reports
    }
    for component, adapters in observation.lora_adapters.items():
        if status_key(component) in roles:
            roles[status_key(component)]["loraAdapters"] = dict(adapters)
    status: dict[str, Any] = {"roles": roles, "conditions": conditions}
    if observed is not None:
        status["observedGeneration"] = observed
    if observation.endpoint is not None:
        svc = observation.endpoint
        status["endpoint"] = f"http://{svc.name}.{svc.namespace}.svc:{svc.port}/v1"
        if svc.external_host:
            status["externalEndpoint"] = f"http://{svc.external_host}:{svc.port}/v1"
    return status
