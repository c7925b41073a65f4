"""The autoscaler's thread: every ``interval_s``, for each autoscaled role of each
ModelDeployment, read its Ready pods, decide, and act on a change.

A change is written to ``status.roles.<role>.autoscaling`` (the size rendering reads, see
``scale.py``), posted as an Event, preceded on scale-in by the pods' deletion costs, and
applied by a reconcile of that ModelDeployment. Reads and decisions happen outside the
reconciler's per-object lock; only the final reconcile takes it, so a slow scrape never
holds up a reconcile. Like drift repair it is a plain thread (no kopf timer: those put a
finalizer on every object).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .. import names
from ..kube import ApiFailure, ModelDeploymentLister, watched_model_deployments
from ..parse import parse_model_deployment
from ..spec import ModelDeployment, SpecError, WorkerRole
from .collector import Collector, PrometheusSource, ScrapeSource, Source
from .decision import Decision, ScaleState, decide
from .metrics import AutoscalerMetrics
from .scale import (
    DELETION_COST_ANNOTATION,
    STATUS_KEY,
    AutoscalerSettings,
    decided_sizes,
    deletion_costs,
    policy_for,
    ready_targets,
    role_status,
    scale_event,
    status_replicas,
)
from .signals import RoleSignals, role_signals

__all__ = ["Autoscaler", "AutoscalerApi"]

log = logging.getLogger(__name__)


class AutoscalerApi(ModelDeploymentLister, Protocol):
    """What the autoscaler needs from the API server (``kube.Cluster`` provides it)."""

    def list_objects(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]: ...

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None: ...

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None: ...

    def create_event(self, event: Mapping[str, Any]) -> None: ...


def _utc(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


class Autoscaler(threading.Thread):
    """Decides and applies the size of every autoscaled role in ``namespaces`` (every
    namespace when empty); ``reconcile(namespace, name)`` renders a decided size."""

    def __init__(
        self,
        api: AutoscalerApi,
        reconcile: Callable[[str, str], object],
        namespaces: Sequence[str],
        settings: AutoscalerSettings,
        metrics: AutoscalerMetrics,
        source: Source | None = None,
    ) -> None:
        super().__init__(name="kvflow-autoscaler", daemon=True)
        self._api = api
        self._reconcile = reconcile
        self._namespaces = tuple(namespaces)
        self.settings = settings
        self.metrics = metrics
        if source is None:
            url = settings.prometheus_url
            source = PrometheusSource(url) if url else ScrapeSource()
        self._collector = Collector(
            source, window_s=max(settings.latency_window_s, settings.gauge_window_s)
        )
        self._states: dict[tuple[str, str, str], ScaleState] = {}
        self._pods: dict[tuple[str, str, str], set[str]] = {}
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(self.settings.interval_s):
            try:
                self.tick()
            except Exception:  # a bug must not end autoscaling for good
                log.exception("autoscaler: tick failed")

    def tick(self, now: float | None = None) -> list[tuple[str, str, str, Decision]]:
        """One round over every ModelDeployment; returns (namespace, name, role, decision)
        of each autoscaled role."""
        now = time.monotonic() if now is None else now
        done: list[tuple[str, str, str, Decision]] = []
        seen: set[tuple[str, str, str]] = set()
        for body in watched_model_deployments(self._api, self._namespaces, "autoscaler"):
            if self._stopped.is_set():
                return done
            if body["metadata"].get("deletionTimestamp"):
                continue
            try:
                md = parse_model_deployment(body)
            except SpecError:
                continue  # the reconciler reports it
            for worker in md.workers:
                if not worker.autoscaling.enabled:
                    continue
                key = (md.namespace, md.name, worker.role)
                seen.add(key)
                try:
                    decision = self._scale(md, body.get("status") or {}, worker, key, now)
                except ApiFailure as exc:  # this role waits for the next tick
                    log.warning("autoscaler: %s/%s: %s", md.namespace, md.name, exc.message)
                    continue
                done.append((*key, decision))
        for key in [k for k in self._states if k not in seen]:
            del self._states[key]
            self._collector.drop(key[0], self._pods.pop(key, set()))
            self.metrics.forget(key)
        return done

    def _scale(
        self,
        md: ModelDeployment,
        status: Mapping[str, Any],
        worker: WorkerRole,
        key: tuple[str, str, str],
        now: float,
    ) -> Decision:
        policy = policy_for(worker, self.settings)
        # the last decided size, even outside bounds narrowed since (the decision then
        # clamps it, recorded as a change); before any decision, the size rendered
        decided = status_replicas(status, worker.role)
        current = decided_sizes(md, status)[worker.role] if decided is None else decided
        selector = (
            f"{names.LABEL_DEPLOYMENT}={md.name},{names.LABEL_ROLE}={worker.role},"
            f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
        )
        pods = self._api.list_objects("v1", "Pod", md.namespace, selector)
        targets = ready_targets(pods)
        windows = self._collector.collect(md.namespace, targets, now)
        names_now = {p["metadata"]["name"] for p in pods}
        self._collector.drop(md.namespace, self._pods.get(key, set()) - names_now)
        self._pods[key] = names_now
        signals = role_signals(
            [t.name for t in targets],
            windows,
            now,
            stale_seconds=self.settings.stale_s,
            gauge_window_s=self.settings.gauge_window_s,
        )
        state = self._states.get(key, ScaleState())
        decision, self._states[key] = decide(policy, signals, current, state, now)
        self.metrics.observe(key, policy, signals, current, decision)
        if decision.changed:
            log.info("%s/%s: %s %s", md.namespace, md.name, worker.role, decision.reason)
            self._apply(md, status, worker.role, decision, current, signals.ready, signals)
        return decision

    def _apply(
        self,
        md: ModelDeployment,
        status: Mapping[str, Any],
        role: str,
        decision: Decision,
        current: int,
        ready: int,
        signals: RoleSignals,
    ) -> None:
        stamp = _utc(time.time())
        if decision.direction == "down":
            for pod, cost in deletion_costs(signals.cached_kv).items():
                self._api.annotate_pod(md.namespace, pod, {DELETION_COST_ANNOTATION: cost})
        # worker roles (unified, prefill, decode) are their own status keys
        previous = ((status.get("roles") or {}).get(role) or {}).get(STATUS_KEY)
        entry = role_status(decision, current, ready, stamp, previous)
        self._api.patch_status(md.namespace, md.name, {"roles": {role: {STATUS_KEY: entry}}})
        self._api.create_event(scale_event(md, role, decision, current, stamp))
        self._reconcile(md.namespace, md.name)
