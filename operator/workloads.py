"""Deployments: one per runtime role, the router's, and the router's API access.

The router discovers workers through the Kubernetes API, so it gets a ServiceAccount with a
namespaced Role that can only read pods.
"""

from __future__ import annotations

from typing import Any

from . import names
from .configmap import worker_config_hash
from .pods import router_pod_template, worker_pod_template
from .spec import ModelDeployment, WorkerRole

REVISION_HISTORY = 3


def _deployment(
    md: ModelDeployment,
    component: str,
    replicas: int,
    template: dict[str, Any],
    rolling_update: dict[str, Any],
    progress_deadline_seconds: int,
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.object_meta(md, names.child_name(md.name, component), component),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": REVISION_HISTORY,
            "progressDeadlineSeconds": progress_deadline_seconds,
            "selector": {"matchLabels": names.selector_labels(md.name, component)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling_update},
            "template": template,
        },
    }


def worker_deployment(md: ModelDeployment, worker: WorkerRole, replicas: int) -> dict[str, Any]:
    """Deployment ``<name>-<role>`` of ``replicas`` pods running ``kvflow serve --role <role>``.

    GPU pods roll one at a time without surge (a surge pod would wait for a free GPU
    forever); CPU pods surge first so capacity never dips. The progress deadline covers
    model loading.
    """
    if worker.gpus:
        rolling = {"maxSurge": 0, "maxUnavailable": 1}
    else:
        rolling = {"maxSurge": 1, "maxUnavailable": 0}
    template = worker_pod_template(md, worker, worker_config_hash(md))
    deadline = worker.startup_timeout_seconds + 600
    return _deployment(md, worker.role, replicas, template, rolling, deadline)


def router_deployment(md: ModelDeployment) -> dict[str, Any]:
    """Deployment ``<name>-router`` running ``kvflow router``."""
    rolling = {"maxSurge": 1, "maxUnavailable": 0}
    template = router_pod_template(md)
    return _deployment(md, names.ROUTER, md.router.replicas, template, rolling, 600)


def router_access(md: ModelDeployment) -> list[dict[str, Any]]:
    """ServiceAccount, Role (read pods) and RoleBinding for the router's worker discovery."""
    name = names.child_name(md.name, names.ROUTER)
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": names.object_meta(md, name, names.ROUTER),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": names.object_meta(md, name, names.ROUTER),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": names.object_meta(md, name, names.ROUTER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": md.namespace}],
        },
    ]
