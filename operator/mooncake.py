"""The Mooncake master (shared HiCache store): a Deployment and its Service.

The master only keeps metadata; the store's memory is lent by the runtime pods. It runs
from the runtime image, which carries the ``mooncake_master`` binary.
"""

from __future__ import annotations

from typing import Any

from kvflow import contract

from . import names
from .podparts import container_security_context, pod_security_context
from .spec import ModelDeployment

MASTER_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}}


def master_deployment(md: ModelDeployment) -> dict[str, Any]:
    """Deployment ``<name>-mooncake-master`` (one replica: the master holds the index)."""
    component = names.MOONCAKE_MASTER
    probe = {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5, "failureThreshold": 3}
    container = {
        "name": "mooncake-master",
        "image": md.image,
        "imagePullPolicy": md.image_pull_policy,
        "command": [
            "mooncake_master",
            f"--rpc_port={contract.MOONCAKE_MASTER_RPC_PORT}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={contract.MOONCAKE_MASTER_METADATA_PORT}",
        ],
        "ports": [
            {"name": "rpc", "containerPort": contract.MOONCAKE_MASTER_RPC_PORT},
            {"name": "metadata", "containerPort": contract.MOONCAKE_MASTER_METADATA_PORT},
        ],
        "resources": MASTER_RESOURCES,
        "securityContext": container_security_context(),
        "readinessProbe": probe,
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": [container],
    }
    if md.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in md.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.object_meta(md, names.child_name(md.name, component), component),
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": names.selector_labels(md.name, component)},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": names.labels(md.name, component)},
                "spec": pod_spec,
            },
        },
    }


def master_service(md: ModelDeployment) -> dict[str, Any]:
    """Service ``<name>-mooncake-master``: RPC and HTTP metadata ports."""
    component = names.MOONCAKE_MASTER
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.object_meta(md, names.child_name(md.name, component), component),
        "spec": {
            "selector": names.selector_labels(md.name, component),
            "ports": [
                {"name": "rpc", "port": contract.MOONCAKE_MASTER_RPC_PORT, "targetPort": "rpc"},
                {
                    "name": "metadata",
                    "port": contract.MOONCAKE_MASTER_METADATA_PORT,
                    "targetPort": "metadata",
                },
            ],
        },
    }
