"""kopf handlers: thin adapters from Kubernetes events to :class:`Reconciler` calls.

- ModelDeployment created, changed, or found at operator start: full reconcile.
- Every ``drift_interval`` seconds: full reconcile of every ModelDeployment (``drift.py``;
  repairs what the event path below missed, re-tries after API outages).
- A child deleted, or edited by another field manager: full reconcile of its owner at once.
- A child Deployment's status moved, or a pod's readiness or failure did: status refresh of
  its owner (pods are read, never written here).
- Every ``--autoscaler-interval`` seconds: the autoscaler thread decides each autoscaled
  role's size from its pods' metrics (``autoscale/loop.py``), annotates pods with deletion
  costs before a scale-in, and reconciles what it changed.

Transient failures become ``kopf.TemporaryError`` (kopf retries with a delay); permanent
ones are written to the ``Degraded`` condition and end the handler with
``kopf.PermanentError``, so a bad spec never turns into a crash or a hot retry loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kopf

from . import names
from .autoscale.loop import Autoscaler
from .autoscale.metrics import AutoscalerMetrics
from .autoscale.scale import AutoscalerSettings
from .drift import DriftRepair
from .kube import ApiFailure, Cluster
from .podstatus import PodReport
from .reconcile import Outcome, Reconciler
from .render import CHILD_KINDS

log = logging.getLogger(__name__)

# Managers whose writes to a child are expected and are not drift.
EXPECTED_MANAGERS = frozenset({names.FIELD_MANAGER, "kube-controller-manager", "kube-scheduler"})
RETRY_DELAY_SECONDS = 10.0


def _raise_for(outcome: Outcome) -> None:
    failure = outcome.failure
    if failure is None:
        return
    if failure.permanent:
        raise kopf.PermanentError(f"{failure.reason}: {failure.message}")
    raise kopf.TemporaryError(f"{failure.reason}: {failure.message}", delay=RETRY_DELAY_SECONDS)


def edited_by_others(body: Mapping[str, Any]) -> bool:
    """Whether a field manager other than the operator and the controllers wrote the spec."""
    for entry in body.get("metadata", {}).get("managedFields") or ():
        if entry.get("subresource") == "status":
            continue
        if entry.get("manager") not in EXPECTED_MANAGERS:
            return True
    return False


class EditFilter:
    """Lets each edit of a child through once.

    A field manager's entry outlives the repair of its edit (``kubectl scale`` keeps owning
    ``spec.replicas`` after the operator's forced apply), so :func:`edited_by_others` stays
    true for every later status event of that child. An edit changes the spec, and so
    ``metadata.generation`` (``resourceVersion`` for kinds without one); a state already
    repaired is not repaired again. The repair's own apply moves the generation once more,
    so an edit costs at most two reconciles.
    """

    def __init__(self) -> None:
        self._repaired: dict[str, str] = {}

    def new_edit(self, body: Mapping[str, Any]) -> bool:
        meta = body.get("metadata", {})
        uid = str(meta.get("uid"))
        version = str(meta.get("generation") or meta.get("resourceVersion"))
        if self._repaired.get(uid) == version:
            return False
        self._repaired[uid] = version
        return True

    def forget(self, body: Mapping[str, Any]) -> None:
        self._repaired.pop(str(body.get("metadata", {}).get("uid")), None)


def deployment_summary(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a Deployment's status the ModelDeployment's status reads."""
    status = body.get("status") or {}
    return (
        body.get("metadata", {}).get("generation"),
        tuple(
            status.get(k)
            for k in ("observedGeneration", "replicas", "readyReplicas", "updatedReplicas")
        ),
        tuple(
            (c.get("type"), c.get("status"), c.get("reason"))
            for c in status.get("conditions") or ()
        ),
    )


class PodFailures:
    """Remembers each pod's failure so that only a change of it refreshes status.

    Readiness needs no pod events: it reaches status through the Deployment's own status
    (``readyReplicas``). What only the pod says is why it fails; a pod that never failed
    triggers nothing, so a rollout's pod events cost no refreshes.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str | None, str]] = {}

    def changed(self, body: Mapping[str, Any], deleted: bool) -> bool:
        uid = str(body.get("metadata", {}).get("uid"))
        before = self._seen.pop(uid, (None, ""))
        if deleted:
            return before[0] is not None
        report = PodReport.from_pod(body)
        now = (report.failure_reason, report.failure_message)
        if now[0] is not None:
            self._seen[uid] = now
        return now != before


class _StatusFilter:
    """Remembers each object's last status summary so unchanged ones are skipped."""

    def __init__(self, summarize: Callable[[Mapping[str, Any]], tuple[Any, ...]]) -> None:
        self._summarize = summarize
        self._seen: dict[str, tuple[Any, ...]] = {}

    def changed(self, body: Mapping[str, Any]) -> bool:
        summary = self._summarize(body)
        uid = str(body.get("metadata", {}).get("uid"))
        if self._seen.get(uid) == summary:
            return False
        self._seen[uid] = summary
        return True

    def forget(self, body: Mapping[str, Any]) -> None:
        self._seen.pop(str(body.get("metadata", {}).get("uid")), None)


def register(
    registry: kopf.OperatorRegistry,
    cluster: Cluster,
    namespaces: Sequence[str],
    drift_interval: float,
    autoscaler_settings: AutoscalerSettings | None = None,
    autoscaler_metrics: AutoscalerMetrics | None = None,
) -> None:
    """Register the operator's handlers in ``registry`` (watching ``namespaces``, or every
    namespace when empty); the autoscaler thread runs beside drift repair."""
    md = (names.GROUP, names.VERSION, names.PLURAL)
    reconciler = Reconciler(cluster)
    drift = DriftRepair(cluster, reconciler, namespaces, drift_interval)
    autoscaler = Autoscaler(
        cluster,
        reconciler.reconcile,
        namespaces,
        autoscaler_settings or AutoscalerSettings(),
        autoscaler_metrics or AutoscalerMetrics(),
    )

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def start_drift_repair(**_: Any) -> None:
        drift.start()
        autoscaler.start()

    @kopf.on.cleanup(registry=registry)
    def stop_drift_repair(**_: Any) -> None:
        drift.stop()
        autoscaler.stop()

    @kopf.on.resume(*md, id="apply-spec", registry=registry)
    @kopf.on.create(*md, id="apply-spec", registry=registry)
    @kopf.on.update(*md, id="apply-spec", field="spec", registry=registry)
    def apply_spec(meta: kopf.Meta, **_: Any) -> None:
        namespace, name = str(meta.namespace), str(meta.name)
        try:
            outcome = reconciler.reconcile(namespace, name)
        except ApiFailure as exc:  # could not even read the ModelDeployment
            raise kopf.TemporaryError(exc.message, delay=RETRY_DELAY_SECONDS) from exc
        if outcome is not None:
            log.info(
                "%s/%s: applied %d, pruned %d", namespace, name, outcome.applied, outcome.pruned
            )
            _raise_for(outcome)

    deployments = _StatusFilter(deployment_summary)
    pod_failures = PodFailures()
    edits = EditFilter()

    def child_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        owner = body.metadata.labels.get(names.LABEL_DEPLOYMENT)
        namespace = body.metadata.namespace
        if not owner or not namespace or event.get("type") is None:
            return  # the initial listing: the ModelDeployment's resume handler covers it
        deleted = event.get("type") == "DELETED"
        if deleted:
            deployments.forget(body)
            edits.forget(body)
        drifted = not deleted and edited_by_others(body) and edits.new_edit(body)
        is_deployment = body.get("kind") == "Deployment"
        try:
            if deleted or drifted:
                what = "deleted" if deleted else "edited"
                log.info(
                    "%s/%s: %s %s %s, repairing",
                    namespace,
                    owner,
                    body.get("kind"),
                    body.metadata.name,
                    what,
                )
                reconciler.reconcile(namespace, owner)
            elif is_deployment and deployments.changed(body):
                reconciler.refresh(namespace, owner)
        except ApiFailure as exc:  # the drift sweep will come back to it
            log.warning("%s/%s: %s", namespace, owner, exc.message)

    def pod_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        owner = body.metadata.labels.get(names.LABEL_DEPLOYMENT)
        namespace = body.metadata.namespace
        if not owner or not namespace or event.get("type") is None:
            return
        if not pod_failures.changed(body, deleted=event.get("type") == "DELETED"):
            return
        try:
            reconciler.refresh(namespace, owner)
        except ApiFailure as exc:  # the drift sweep will come back to it
            log.warning("%s/%s: %s", namespace, owner, exc.message)

    kopf.on.event(
        "v1",
        "pods",
        labels={names.LABEL_MANAGED_BY: names.MANAGED_BY},
        id="pod-status",
        registry=registry,
    )(pod_event)

    for api_version, kind in CHILD_KINDS:
        kopf.on.event(
            api_version,
            kind,
            labels={names.LABEL_MANAGED_BY: names.MANAGED_BY},
            id=f"child-{kind.lower()}",
            registry=registry,
        )(child_event)
