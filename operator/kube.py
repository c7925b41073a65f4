"""The operator's only door to the API server: apply, list and delete children; read and
patch ModelDeployments.

Every call is retried with exponential backoff on conflicts, throttling, server errors and
broken connections; what is still failing afterwards, or fails for good (invalid object,
forbidden), is raised as :class:`ApiFailure` with ``permanent`` telling the two apart.
Paths are built from a static table, so no API discovery is needed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from . import lwsapi, names

log = logging.getLogger(__name__)
T = TypeVar("T")

# (apiVersion, kind) -> plural, for every kind the operator touches.
PLURALS: Mapping[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Pod"): "pods",  # read, and annotated with deletion costs by the autoscaler
    ("v1", "Event"): "events",  # the autoscaler's decisions
    ("v1", "Secret"): "secrets",  # created once (the internal key), never read
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("apps/v1", "Deployment"): "deployments",
    (lwsapi.API_VERSION, lwsapi.KIND): lwsapi.PLURAL,  # only where LWS's CRD is installed
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    (names.API_VERSION, names.KIND): names.PLURAL,
}
# HTTP status of a failed call -> the condition reason of a failure that retrying cannot fix.
PERMANENT_FAILURES = {400: "ApplyRejected", 403: "Forbidden", 404: "NotFound", 422: "ApplyRejected"}


class ApiFailure(Exception):
    """An API call that did not succeed; ``reason`` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str, permanent: bool, status: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.permanent = permanent
        self.status = status


@dataclass(frozen=True)
class Backoff:
    """Retry schedule: ``attempts`` tries, sleeping ``first * factor**n`` (capped) between."""

    attempts: int = 5
    first: float = 0.2
    factor: float = 2.0
    cap: float = 5.0

    def delays(self) -> Iterable[float]:
        delay = self.first
        for _ in range(self.attempts - 1):
            yield min(delay, self.cap)
            delay *= self.factor


RETRIED = (ApiException, urllib3.exceptions.HTTPError, OSError)


def _failure(exc: Exception) -> ApiFailure:
    status = int(getattr(exc, "status", 0) or 0)
    message = str(exc)
    body = getattr(exc, "body", None)
    if body:
        try:
            message = json.loads(body).get("message", message)
        except (ValueError, AttributeError):
            message = str(body)
    if status in PERMANENT_FAILURES:
        return ApiFailure(PERMANENT_FAILURES[status], message, True, status)
    reason = "Conflict" if status == 409 else "ApiUnavailable"
    return ApiFailure(reason, message or type(exc).__name__, False, status)


def with_backoff(call: Callable[[], T], backoff: Backoff, what: str) -> T:
    """Run ``call``; retry transient failures on ``backoff``'s schedule."""
    delays = iter(backoff.delays())
    while True:
        try:
            return call()
        except RETRIED as exc:
            failure = _failure(exc)
            if failure.permanent:
                raise failure from exc
            delay = next(delays, None)
            if delay is None:
                raise failure from exc
            log.info("retrying %s in %.1fs: %s", what, delay, failure.message)
            time.sleep(delay)


def resource_path(api_version: str, kind: str, namespace: str, name: str = "") -> str:
    """REST path of a namespaced object (or of its collection when ``name`` is empty)."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"
    return f"{path}/{name}" if name else path


def _raw(_client: object, data: Any) -> Any:
    return data


class Cluster:
    """Typed wrapper over one API client; see the module docstring for error semantics."""

    def __init__(self, api_client: k8s.ApiClient, backoff: Backoff | None = None) -> None:
        self._dyn = DynamicClient(api_client)
        self._backoff = backoff or Backoff()

    def _request(self, method: str, path: str, what: str, **params: Any) -> Any:
        call = lambda: self._dyn.request(method, path, serializer=_raw, **params)  # noqa: E731
        return with_backoff(call, self._backoff, what)

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager, taking over conflicting fields."""
        meta = manifest["metadata"]
        path = resource_path(
            manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]
        )
        return self._request(
            "patch",
            path,
            f"apply {manifest['kind']}/{meta['name']}",
            body=manifest,
            content_type="application/apply-patch+yaml",
            field_manager=names.FIELD_MANAGER,
            force_conflicts=True,
        )

    def create_if_absent(self, manifest: Mapping[str, Any]) -> bool:
        """Create an object unless one of its name exists (False then; it is not read)."""
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        try:
            self._request("post", path, f"create {manifest['kind']}/{meta['name']}", body=manifest)
        except ApiFailure as failure:
            if failure.status == 409:
                return False
            raise
        return True

    def list_objects(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        """Objects of one kind matching a label selector, each with apiVersion and kind set."""
        path = resource_path(api_version, kind, namespace)
        result = self._request("get", path, f"list {kind}", label_selector=selector)
        items = result.get("items") or []
        for item in items:
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return list(items)

    def list_nodes(self) -> list[dict[str, Any]]:
        """Every node (cluster-scoped; read for the resources they advertise)."""
        result = self._request("get", "/api/v1/nodes", "list Node")
        return list(result.get("items") or [])

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves ``kind`` at ``api_version`` (its CRD is installed)."""
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            found = self._request("get", prefix, f"discover {api_version}")
        except ApiFailure as failure:
            if failure.status == 404:
                return False
            raise
        return any(r.get("kind") == kind for r in found.get("resources") or ())

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete one object (background propagation); already gone is fine."""
        path = resource_path(api_version, kind, namespace, name)
        try:
            self._request("delete", path, f"delete {kind}/{name}", propagation_policy="Background")
        except ApiFailure as failure:
            if failure.status != 404:
                raise

    def get_model_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The ModelDeployment, or None when it no longer exists."""
        path = resource_path(names.API_VERSION, names.KIND, namespace, name)
        try:
            return dict(self._request("get", path, f"get {names.KIND}/{name}"))
        except ApiFailure as failure:
            if failure.status == 404:
                return None
            raise

    def list_model_deployments(self, namespace: str | None) -> list[dict[str, Any]]:
        """ModelDeployments in one namespace, or in all when ``namespace`` is None."""
        if namespace is None:
            path = f"/apis/{names.API_VERSION}/{names.PLURAL}"
        else:
            path = resource_path(names.API_VERSION, names.KIND, namespace)
        result = self._request("get", path, f"list {names.KIND}")
        items = list(result.get("items") or [])
        for item in items:
            item.setdefault("apiVersion", names.API_VERSION)
            item.setdefault("kind", names.KIND)
        return items

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Merge ``annotations`` into a pod's (a pod gone meanwhile is fine)."""
        path = resource_path("v1", "Pod", namespace, name)
        try:
            self._request(
                "patch",
                path,
                f"annotate Pod/{name}",
                body={"metadata": {"annotations": dict(annotations)}},
                content_type="application/merge-patch+json",
            )
        except ApiFailure as failure:
            if failure.status != 404:
                raise

    def create_event(self, event: Mapping[str, Any]) -> None:
        """Create a core/v1 Event in its namespace."""
        path = resource_path("v1", "Event", event["metadata"]["namespace"])
        self._request("post", path, f"create Event {event.get('reason')}", body=dict(event))

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """JSON merge patch of the status subresource (``None`` values delete keys)."""
        path = resource_path(names.API_VERSION, names.KIND, namespace, name) + "/status"
        try:
            self._request(
                "patch",
                path,
                f"patch status {names.KIND}/{name}",
                body={"status": patch},
                content_type="application/merge-patch+json",
            )
        except ApiFailure as failure:
            if failure.status != 404:  # deleted meanwhile: nothing to report on
                raise


class ModelDeploymentLister(Protocol):
    """The one call :func:`watched_model_deployments` needs (``Cluster`` provides it)."""

    def list_model_deployments(self, namespace: str | None) -> list[dict[str, Any]]: ...


def watched_model_deployments(
    api: ModelDeploymentLister, namespaces: Sequence[str], who: str
) -> Iterator[dict[str, Any]]:
    """Every ModelDeployment in ``namespaces`` (every namespace when empty), one namespace's
    listing at a time. A listing that fails is logged as ``who``'s and skipped: the other
    namespaces still come."""
    each: list[str | None] = [*namespaces] or [None]
    for namespace in each:
        try:
            bodies = api.list_model_deployments(namespace)
        except ApiFailure as exc:
            log.warning("%s: cannot list ModelDeployments: %s", who, exc.message)
            continue
        yield from bodies
