"""Services: the router Service (the OpenAI endpoint) and a headless Service per role."""

from __future__ import annotations

from typing import Any

from . import names
from .podparts import API_PORT_NAME, BOOTSTRAP_PORT_NAME
from .spec import ModelDeployment, WorkerRole


def endpoint_service(md: ModelDeployment) -> dict[str, Any]:
    """Service ``<name>``: the in-cluster OpenAI-compatible endpoint in front of the router."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.object_meta(md, md.name, names.ROUTER),
        "spec": {
            "type": md.endpoint.service_type,
            "selector": names.selector_labels(md.name, names.ROUTER),
            "ports": [
                {
                    "name": API_PORT_NAME,
                    "port": md.endpoint.port,
                    "targetPort": API_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def headless_service(md: ModelDeployment, worker: WorkerRole) -> dict[str, Any]:
    """Service ``<name>-<role>`` without a cluster IP: DNS lists the role's ready pods (of a
    role over several nodes, the groups' leaders: the other pods serve no HTTP)."""
    ports: list[dict[str, Any]] = [
        {
            "name": API_PORT_NAME,
            "port": md.endpoint.port,
            "targetPort": API_PORT_NAME,
            "protocol": "TCP",
        }
    ]
    if worker.role == "prefill":
        bootstrap = md.kv_transfer.bootstrap_port
        ports.append(
            {
                "name": BOOTSTRAP_PORT_NAME,
                "port": bootstrap,
                "targetPort": BOOTSTRAP_PORT_NAME,
                "protocol": "TCP",
            }
        )
    selector = names.selector_labels(md.name, worker.role)
    if worker.spans_nodes:
        selector[names.LABEL_NODE] = names.NODE_LEADER
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.object_meta(md, names.child_name(md.name, worker.role), worker.role),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": ports,
        },
    }
