"""The Mooncake master (shared HiCache store): a Deployment and its Service.

The master only keeps metadata; the store's memory is lent by the runtime pods. It runs
from the runtime image (which carries the ``mooncake_master`` binary) unless
``spec.mooncakeMaster.image`` names another.
"""

from __future__ import annotations

from typing import Any

from . import names
from .placement import cluster_master, master_argv, metadata_server_argv
from .podparts import (
    POD_IP_FIELD,
    apply_pod_settings,
    container_ports,
    container_resources,
    container_security_context,
    pod_security_context,
    user_mounts,
)
from .spec import ModelDeployment

MASTER_REQUESTS = {"cpu": "100m", "memory": "256Mi"}
METADATA_REQUESTS = {"cpu": "50m", "memory": "64Mi"}  # an aiohttp process and a dict


def _ports(md: ModelDeployment) -> dict[str, int]:
    master = md.mooncake_master
    return {
        "rpc": master.rpc_port,
        "metadata": master.metadata_port,
        "metrics": master.metrics_port,
    }


def _container(
    md: ModelDeployment,
    name: str,
    argv: list[str],
    ports: dict[str, int],
    resources: dict[str, Any],
) -> dict[str, Any]:
    """One container of the master's pod, probed on its first port."""
    settings = md.mooncake_master.pods
    probe = {"tcpSocket": {"port": next(iter(ports))}, "periodSeconds": 5, "failureThreshold": 3}
    container: dict[str, Any] = {
        "name": name,
        "image": md.mooncake_master_image,
        "imagePullPolicy": md.image_pull_policy,
        "command": argv,
        "ports": container_ports(ports, settings.host_network),
        "resources": resources,
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": probe,
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
    }
    # a host-network master binds its pod IP (see placement.POD_IP)
    env = [*([POD_IP_FIELD] if settings.host_network else []), *(dict(e) for e in settings.env)]
    if env:
        container["env"] = env
    if settings.volume_mounts:
        container["volumeMounts"] = user_mounts(settings)
    return container


def master_deployment(md: ModelDeployment) -> dict[str, Any]:
    """Deployment ``<name>-mooncake-master`` (one replica: the master holds the index).

    On the host network the HTTP metadata server runs in a container of its own
    (``metadata``), bound to the pod IP: the master's built-in one binds every interface.
    """
    component = names.MOONCAKE_MASTER
    settings = md.mooncake_master.pods
    placement = cluster_master(md)
    ports = _ports(md)
    master_ports = dict(ports)
    if placement.separate_metadata_server:
        del master_ports["metadata"]
    resources = container_resources({**MASTER_REQUESTS, **settings.requests}, settings.limits)
    containers = [
        _container(md, "mooncake-master", master_argv(placement), master_ports, resources)
    ]
    if placement.separate_metadata_server:
        metadata = {"metadata": ports["metadata"]}
        requests = container_resources(METADATA_REQUESTS, {})
        argv = metadata_server_argv(placement)
        containers.append(_container(md, "metadata", argv, metadata, requests))
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": containers,
    }
    if md.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in md.image_pull_secrets]
    apply_pod_settings(pod_spec, settings)
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
    """Service ``<name>-mooncake-master``: RPC and HTTP metadata ports (metrics stay on the pod)."""
    component = names.MOONCAKE_MASTER
    ports = _ports(md)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.object_meta(md, names.child_name(md.name, component), component),
        "spec": {
            "selector": names.selector_labels(md.name, component),
            "ports": [
                {"name": name, "port": ports[name], "targetPort": name}
                for name in ("rpc", "metadata")
            ],
        },
    }
