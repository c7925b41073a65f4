"""One reconcile of one ModelDeployment: render, apply, prune, observe, report.

:meth:`Reconciler.reconcile` makes the children match the spec; :meth:`Reconciler.refresh`
only recomputes status from the children. Both end by writing status (only when it
changed). Calls for the same ModelDeployment are serialized by a per-object lock, so the
handlers (spec change, drift timer, child events) may call from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvflow import contract

from . import lwsapi, names
from .autoscale.scale import decided_sizes, without_autoscaling
from .internal_key import internal_key_secret, new_internal_key
from .kube import PERMANENT_FAILURES, ApiFailure, Cluster
from .lora import pods_to_annotate
from .lora_status import adapters_by_role, read_router_metrics
from .parse import parse_model_deployment
from .podstatus import PodReport
from .rdma import RDMA_UNAVAILABLE, rdma_refusal, uses_rdma
from .render import CHILD_KINDS, OPTIONAL_KINDS, child_key, render_children
from .spec import ModelDeployment, SpecError, WorkerRole
from .status import Failure, Observation, ServiceReport, WorkloadReport, compute_status
from .stores import shared_store

log = logging.getLogger(__name__)


LWS_UNAVAILABLE = "LeaderWorkerSetUnavailable"


def lws_refusal(worker: WorkerRole) -> str:
    """Why a role over several nodes is not applied where LWS's CRD is not installed."""
    return (
        f"spec.{worker.role}.nodesPerReplica is {worker.nodes_per_replica}: a role over "
        f"several nodes runs as a {lwsapi.KIND} ({lwsapi.API_VERSION}), which this cluster "
        "does not serve; install LeaderWorkerSet (sigs.k8s.io/lws v0.7.0, docs/operator.md) "
        "(the drift sweep applies the spec once it does)"
    )


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def expected_components(md: ModelDeployment) -> list[str]:
    """Components whose Deployments must exist and be ready for the model to serve."""
    components = [worker.role for worker in md.workers] + [names.ROUTER]
    store = shared_store(md)
    return components + (store.components() if store is not None else [])


@dataclass(frozen=True)
class Outcome:
    """What one reconcile did and reported."""

    applied: int
    pruned: int
    status: Mapping[str, Any]
    failure: Failure | None


def _owned(obj: Mapping[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or ()
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Merge patch turning ``old`` status into ``new``: keys gone from ``new`` become None,
    at any depth (a role that went away, an adapter no longer listed); lists are replaced."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = status_patch(before, value)
        else:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


class Reconciler:
    """Drives children and status of ModelDeployments through a :class:`Cluster`."""

    def __init__(self, cluster: Cluster, clock: Callable[[], str] = utc_now) -> None:
        self._cluster = cluster
        self._clock = clock
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Apply every rendered child, prune obsolete ones, then report status.

        The ModelDeployment is read afresh under the lock, so a caller holding an older
        copy (a watch event, a listing) never writes stale status. None when it is gone or
        being deleted (the garbage collector removes the children).
        """
        with self._lock(namespace, name):
            body = self._fetch(namespace, name)
            if body is None:
                return None
            failure: Failure | None = None
            applied = pruned = 0
            components: list[str] | None = None
            md: ModelDeployment | None = None
            try:
                md = parse_model_deployment(body)
                components = expected_components(md)
                failure = self._refusal(md)
                if failure is None:
                    # autoscaled roles render the size the autoscaler decided (in status)
                    children = render_children(md, decided_sizes(md, body.get("status")))
                    if md.disaggregated:  # the pods read it: it exists before they do
                        secret = internal_key_secret(md, new_internal_key())
                        self._cluster.create_if_absent(secret)
                    for child in children:
                        self._cluster.apply(child)
                        applied += 1
                    pruned = self._prune(md, {child_key(c) for c in children})
                    self._hand_adapters(md)
            except SpecError as exc:
                failure = Failure("InvalidSpec", str(exc), permanent=True)
            except ApiFailure as exc:
                failure = Failure(exc.reason, exc.message, exc.permanent)
            if failure is not None:
                log.warning("%s/%s: %s: %s", namespace, name, failure.reason, failure.message)
            status = self._report(body, components, failure, md)
            return Outcome(applied, pruned, status, failure)

    def refresh(self, namespace: str, name: str) -> Outcome | None:
        """Recompute and write status from the children, changing nothing else."""
        with self._lock(namespace, name):
            body = self._fetch(namespace, name)
            if body is None:
                return None
            components = None
            md: ModelDeployment | None = None
            with contextlib.suppress(SpecError):  # unparseable: report what exists
                md = parse_model_deployment(body)
                components = expected_components(md)
                try:  # new pods get the adapter list as soon as they show up
                    self._hand_adapters(md)
                except ApiFailure as exc:  # the next reconcile or refresh tries again
                    log.warning("%s/%s: cannot annotate pods: %s", namespace, name, exc.message)
            previous = _previous_failure(body)
            status = self._report(body, components, previous, md)
            return Outcome(0, 0, status, previous)

    def _refusal(self, md: ModelDeployment) -> Failure | None:
        """What the cluster lacks for this spec (nothing is applied then): an RDMA device
        for ``kvTransfer.protocol: rdma``, the LeaderWorkerSet API for a role over several
        nodes. Nodes and API groups are read only for such specs."""
        spanning = [w for w in md.workers if w.spans_nodes]
        if spanning and not self._cluster.serves(lwsapi.API_VERSION, lwsapi.KIND):
            return Failure(LWS_UNAVAILABLE, lws_refusal(spanning[0]), permanent=True)
        if not uses_rdma(md):
            return None
        message = rdma_refusal(md, self._cluster.list_nodes())
        return None if message is None else Failure(RDMA_UNAVAILABLE, message, permanent=True)

    def _hand_adapters(self, md: ModelDeployment) -> None:
        """Annotate each running worker pod with the LoRA adapters it should have loaded
        (``spec.lora``): the router loads and unloads them (see ``lora.py``)."""
        if md.lora is None:
            return
        pods = self._cluster.list_objects("v1", "Pod", md.namespace, names.owned_selector(md.name))
        for pod_name, value in pods_to_annotate(md, pods):
            self._cluster.annotate_pod(
                md.namespace, pod_name, {contract.LORA_ADAPTERS_ANNOTATION: value}
            )

    def _fetch(self, namespace: str, name: str) -> dict[str, Any] | None:
        body = self._cluster.get_model_deployment(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        return body

    def _children(self, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
        selector = names.owned_selector(name)
        found: list[dict[str, Any]] = []
        for api_version, kind in CHILD_KINDS:
            try:
                items = self._cluster.list_objects(api_version, kind, namespace, selector)
            except ApiFailure as failure:  # a kind whose CRD is not installed: none of it
                if failure.status != 404 or (api_version, kind) not in OPTIONAL_KINDS:
                    raise
                continue
            # Objects already being deleted (a pruned claim held by its pvc-protection
            # finalizer, say) are neither desired state nor worth deleting again.
            found += [
                item
                for item in items
                if _owned(item, uid) and not item["metadata"].get("deletionTimestamp")
            ]
        return found

    def _prune(self, md: ModelDeployment, keep: set[tuple[str, str, str]]) -> int:
        pruned = 0
        for child in self._children(md.namespace, md.name, md.uid):
            if child_key(child) not in keep:
                log.info(
                    "%s/%s: pruning %s %s",
                    md.namespace,
                    md.name,
                    child["kind"],
                    child["metadata"]["name"],
                )
                self._cluster.delete(
                    child["apiVersion"], child["kind"], md.namespace, child["metadata"]["name"]
                )
                pruned += 1
        return pruned

    def _observe(
        self, namespace: str, name: str, uid: str, md: ModelDeployment | None = None
    ) -> Observation:
        children = self._children(namespace, name, uid)
        workloads = {}
        endpoint = None
        generations = []
        for child in children:
            annotation = (child["metadata"].get("annotations") or {}).get(
                names.ANNOTATION_GENERATION
            )
            if annotation is not None and annotation.isdigit():
                generations.append(int(annotation))
            if child["kind"] == "Deployment":
                report = WorkloadReport.from_deployment(child)
                workloads[report.component] = report
            elif child["kind"] == lwsapi.KIND:
                report = WorkloadReport.from_leader_worker_set(child)
                workloads[report.component] = report
            elif child["kind"] == "Service" and child["metadata"]["name"] == name:
                endpoint = ServiceReport.from_service(child)
        pods: dict[str, list[PodReport]] = {}
        listed = self._cluster.list_objects("v1", "Pod", namespace, names.owned_selector(name))
        for pod in listed:
            if not pod["metadata"].get("deletionTimestamp"):
                pod_report = PodReport.from_pod(pod)
                pods.setdefault(pod_report.component, []).append(pod_report)
        lora: dict[str, dict[str, str]] = {}
        if md is not None and md.lora is not None:
            text = read_router_metrics(md, listed)
            lora = adapters_by_role(md, listed, text) if text is not None else {}
        return Observation(workloads, endpoint, generations, pods, lora)

    def _report(
        self,
        body: Mapping[str, Any],
        components: Sequence[str] | None,
        failure: Failure | None,
        md: ModelDeployment | None = None,
    ) -> dict[str, Any]:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        # the autoscaler's entries are its own: never compared, never patched from here
        old = without_autoscaling(body.get("status") or {})
        try:
            observation = self._observe(namespace, name, meta["uid"], md)
            if components is None:  # unparseable spec: report what exists
                components = sorted(observation.workloads)
            status = compute_status(
                int(meta.get("generation") or 1),
                components,
                observation,
                failure,
                old.get("conditions") or (),
                self._clock(),
            )
            if status != old:
                self._cluster.patch_status(namespace, name, status_patch(old, status))
        except ApiFailure as exc:
            log.warning("%s/%s: cannot report status: %s", namespace, name, exc.message)
            return old
        return status


PERMANENT_REASONS = frozenset(
    {"InvalidSpec", RDMA_UNAVAILABLE, LWS_UNAVAILABLE, *PERMANENT_FAILURES.values()}
)


def _previous_failure(body: Mapping[str, Any]) -> Failure | None:
    """A permanent apply failure already reported stays reported until the next reconcile."""
    for condition in (body.get("status") or {}).get("conditions") or ():
        degraded = condition.get("type") == "Degraded" and condition.get("status") == "True"
        if degraded and condition.get("reason") in PERMANENT_REASONS:
            return Failure(condition["reason"], condition.get("message", ""), permanent=True)
    return None
