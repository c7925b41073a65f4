"""Everything a ModelDeployment owns, as manifests, from its spec alone.

:func:`render_children` is pure: the same spec and sizes give the same manifests, byte for
byte, which is what the golden-file tests pin down and what makes re-applying them a no-op.
"""

from __future__ import annotations

import json
from typing import Any

from . import lwsapi
from .configmap import runtime_config_map
from .leaderworkerset import worker_leader_worker_set
from .policies import disruption_budgets, network_policies
from .services import endpoint_service, headless_service
from .sizes import DesiredSizes, desired_sizes
from .spec import ModelDeployment, WorkerRole
from .stores import shared_store
from .workloads import router_access, router_deployment, worker_deployment

# Kinds a ModelDeployment may own: (apiVersion, kind). The operator lists these to prune
# children a spec change made obsolete; the chart's RBAC grants exactly these.
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "PersistentVolumeClaim"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    (lwsapi.API_VERSION, lwsapi.KIND),  # a role over several nodes; see OPTIONAL_KINDS
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)

# Kinds served only where their CRD is installed: listing them finds nothing elsewhere.
OPTIONAL_KINDS: frozenset[tuple[str, str]] = frozenset({(lwsapi.API_VERSION, lwsapi.KIND)})


def worker_workload(md: ModelDeployment, worker: WorkerRole, replicas: int) -> dict[str, Any]:
    """A role's pods: a Deployment, or a LeaderWorkerSet when a replica spans nodes."""
    if worker.spans_nodes:
        return worker_leader_worker_set(md, worker, replicas)
    return worker_deployment(md, worker, replicas)


def render_children(md: ModelDeployment, sizes: DesiredSizes | None = None) -> list[dict[str, Any]]:
    """All child manifests, in apply order (configuration and identities before workloads).

    ``sizes`` are the worker roles' replicas (the reconciler passes the autoscaler's, see
    ``autoscale.scale.decided_sizes``); None renders the spec's own, as before any decision.
    """
    sizes = desired_sizes(md) if sizes is None else sizes
    store = shared_store(md)
    children: list[dict[str, Any]] = [runtime_config_map(md), *router_access(md)]
    children += store.claims() if store is not None else []
    children.append(endpoint_service(md))
    children += [headless_service(md, worker) for worker in md.workers]
    children += store.workloads() if store is not None else []
    children += [worker_workload(md, worker, sizes[worker.role]) for worker in md.workers]
    children.append(router_deployment(md))
    children += disruption_budgets(md)
    children += network_policies(md)
    # Plain JSON data: no shared sub-objects between manifests, nothing unserializable.
    return [json.loads(json.dumps(child)) for child in children]


def child_key(manifest: dict[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name): how a child is identified within its namespace."""
    return (manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])
