"""The Mooncake master (the Mooncake store's metadata): where it runs, its commands, and in
the cluster its Deployment and Service.

The master only keeps metadata; the store's memory is lent by the store clients. In the
cluster it runs from the runtime image (which carries the ``mooncake_master`` binary)
unless ``spec.mooncakeMaster.image`` names another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow import contract

from .. import names
from ..placement import ALL_INTERFACES, POD_IP
from ..podparts import (
    POD_IP_FIELD,
    apply_pod_settings,
    container_ports,
    container_resources,
    container_security_context,
    pod_security_context,
    user_mounts,
)
from ..spec import ModelDeployment

MASTER = "mooncake-master"  # the component: its Deployment, Service, pods and policy
MASTER_REQUESTS = {"cpu": "100m", "memory": "256Mi"}
METADATA_REQUESTS = {"cpu": "50m", "memory": "64Mi"}  # an aiohttp process and a dict


@dataclass(frozen=True)
class MasterPlacement:
    """The Mooncake master: the host its clients dial, its ports, the address it binds."""

    host: str
    rpc_port: int = contract.MOONCAKE_MASTER_RPC_PORT
    metadata_port: int = contract.MOONCAKE_MASTER_METADATA_PORT
    metrics_port: int = contract.MOONCAKE_MASTER_METRICS_PORT
    bind_host: str | None = None  # None: the master's default (every interface)
    # The HTTP metadata server as a process of its own (:func:`metadata_server_argv`) rather
    # than the master's built-in one, which (Mooncake 0.3.13) binds every interface
    # whatever ``--http_metadata_server_host`` says.
    separate_metadata_server: bool = False

    @property
    def rpc_address(self) -> str:
        """``host:port`` of the master's RPC endpoint (``--hicache-storage-path``)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"


def master_argv(master: MasterPlacement) -> list[str]:
    """The ``mooncake_master`` command (no etcd; the HTTP metadata server built in unless
    ``master.separate_metadata_server``)."""
    argv = ["mooncake_master", f"--rpc_port={master.rpc_port}"]
    if master.separate_metadata_server:
        argv.append("--enable_http_metadata_server=false")
    else:
        argv += [
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={master.metadata_port}",
        ]
    argv.append(f"--metrics_port={master.metrics_port}")
    if master.bind_host is not None:
        argv.append(f"--rpc_address={master.bind_host}")
        if not master.separate_metadata_server:
            argv.append(f"--http_metadata_server_host={master.bind_host}")
        argv.append(f"--metrics_host={master.bind_host}")
    return argv


def metadata_server_argv(master: MasterPlacement) -> list[str]:
    """Mooncake's own HTTP metadata server (the ``/metadata`` key-value routes the store
    clients use), binding ``master.bind_host`` (every interface when unset)."""
    host = master.bind_host or ALL_INTERFACES
    return ["mooncake_http_metadata_server", "--host", host, "--port", str(master.metadata_port)]


def cluster_master(md: ModelDeployment) -> MasterPlacement:
    """The master as pods reach it: ``spec.mooncakeMaster.host``, else its Service's name.
    On the host network it binds its pod IP (the node's), with the metadata server as a
    process of its own (the built-in one would bind every interface of the node); else
    every interface of its pod."""
    master = md.mooncake_master
    service = f"{names.child_name(md.name, MASTER)}.{md.namespace}.svc"
    return MasterPlacement(
        host=master.host or service,
        rpc_port=master.rpc_port,
        metadata_port=master.metadata_port,
        metrics_port=master.metrics_port,
        bind_host=POD_IP if master.pods.host_network else None,
        separate_metadata_server=master.pods.host_network,
    )


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
    component = MASTER
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
    component = MASTER
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
