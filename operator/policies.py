"""PodDisruptionBudgets and NetworkPolicies.

Ingress is opened narrowly: the router's API port to any client; a worker's API port only
to the router (and to namespaces allowed to scrape metrics); the KV bootstrap port and the
KV transfer port range only between prefill and decode pods of the same deployment (and
between all workers when their shared store pools their memory); every port between the
pods of a role over several nodes (gloo/NCCL choose theirs); a shared store's own pods
as the store says (:meth:`SharedStore.policies`). Egress is left open (model downloads, Kubernetes API for the router).
"""

from __future__ import annotations

from typing import Any

from kvflow import contract

from . import names
from .podparts import API_PORT_NAME, BOOTSTRAP_PORT_NAME
from .spec import ModelDeployment
from .stores import shared_store


def disruption_budgets(md: ModelDeployment) -> list[dict[str, Any]]:
    """One PDB per component: voluntary evictions take at most one pod at a time."""
    components = [worker.role for worker in md.workers] + [names.ROUTER]
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": names.object_meta(md, names.child_name(md.name, component), component),
            "spec": {
                "maxUnavailable": 1,
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
                "selector": {"matchLabels": names.selector_labels(md.name, component)},
            },
        }
        for component in components
    ]


def role_peers(md: ModelDeployment, *roles: str) -> dict[str, Any]:
    """A NetworkPolicy peer: this deployment's pods of the given roles."""
    return {
        "podSelector": {
            "matchExpressions": [
                {"key": names.LABEL_DEPLOYMENT, "operator": "In", "values": [md.name]},
                {"key": names.LABEL_ROLE, "operator": "In", "values": list(roles)},
            ]
        }
    }


def _kv_ports() -> list[dict[str, Any]]:
    first, last = contract.KV_TRANSFER_PORT_RANGE
    return [{"protocol": "TCP", "port": first, "endPort": last}]


def ingress_policy(
    md: ModelDeployment, component: str, ingress: list[dict[str, Any]]
) -> dict[str, Any]:
    """A NetworkPolicy admitting ``ingress`` to one component's pods."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.object_meta(md, names.child_name(md.name, component), component),
        "spec": {
            "podSelector": {"matchLabels": names.selector_labels(md.name, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def network_policies(md: ModelDeployment) -> list[dict[str, Any]]:
    """The deployment's NetworkPolicies (none when ``spec.networkPolicy.enabled`` is false)."""
    if not md.network_policy.enabled:
        return []
    api_port = [{"protocol": "TCP", "port": API_PORT_NAME}]
    store = shared_store(md)
    worker_roles = [worker.role for worker in md.workers]
    api_from: list[dict[str, Any]] = [role_peers(md, names.ROUTER)]
    if md.network_policy.metrics_namespace_labels:
        selector = {"matchLabels": dict(md.network_policy.metrics_namespace_labels)}
        api_from.append({"namespaceSelector": selector})
    policies = [ingress_policy(md, names.ROUTER, [{"ports": api_port}])]
    for worker in md.workers:
        role = worker.role
        ingress: list[dict[str, Any]] = [{"from": api_from, "ports": api_port}]
        if role == "prefill":
            bootstrap = [{"protocol": "TCP", "port": BOOTSTRAP_PORT_NAME}]
            ingress.append({"from": [role_peers(md, "decode")], "ports": bootstrap + _kv_ports()})
        if role == "decode":
            ingress.append({"from": [role_peers(md, "prefill")], "ports": _kv_ports()})
        if worker.spans_nodes:  # the ranks' collectives pick their own ports
            ingress.append({"from": [role_peers(md, role)]})
        if store is not None and store.pools_worker_memory:
            ingress.append({"from": [role_peers(md, *worker_roles)], "ports": _kv_ports()})
        policies.append(ingress_policy(md, role, ingress))
    if store is not None:
        policies += store.policies()
    return policies
