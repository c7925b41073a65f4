"""Pieces every kvflow pod shares: security contexts, probes, resources, secret env vars.

Pods meet the ``restricted`` Pod Security Standard (non-root, no privilege escalation, all
capabilities dropped, RuntimeDefault seccomp) with a read-only root filesystem; writable
paths are emptyDir volumes. The images create user and group 1000.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kvflow import contract

from .quantity import format_bytes, parse_quantity
from .spec import PodSettings, SecretKeyRef

RUN_AS_ID = 1000
API_PORT_NAME = contract.API_PORT_NAME
BOOTSTRAP_PORT_NAME = contract.BOOTSTRAP_PORT_NAME
DIST_INIT_PORT_NAME = "dist-init"  # leader of a group over several nodes (--dist-init-addr)
GPU_RESOURCE = "nvidia.com/gpu"
# The pod's IP from its status: what a pod advertises to peers, and what a host-network
# pod binds (the kubelet expands ``$(KVFLOW_POD_IP)`` in its command).
POD_IP_FIELD = {
    "name": contract.POD_IP_ENV,
    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
}


def pod_security_context() -> dict[str, Any]:
    """Pod-level settings of the restricted Pod Security Standard."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_ID,
        "runAsGroup": RUN_AS_ID,
        "fsGroup": RUN_AS_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(add_capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    """Container-level restricted settings; ``add_capabilities`` leaves the restricted level
    (only RDMA's IPC_LOCK asks for it)."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add_capabilities:
        capabilities["add"] = list(add_capabilities)
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": capabilities,
    }


def http_probes(
    startup_timeout_seconds: int,
    period_seconds: int = 10,
    readiness_path: str = contract.HEALTH_PATH,
) -> dict[str, Any]:
    """Startup and liveness probes on :data:`contract.HEALTH_PATH`, readiness on
    ``readiness_path``.

    The startup probe allows ``startup_timeout_seconds`` for model loading (weights download,
    conversion, CUDA graph capture); liveness only starts after it succeeds, so a slow load
    is never killed early. Readiness takes a pod out of the Services while it is busy
    starting or stuck (the router's: while it has no healthy worker of a role it needs).
    """
    http_get = {"path": contract.HEALTH_PATH, "port": API_PORT_NAME}
    startup_failures = max(1, -(-startup_timeout_seconds // period_seconds))
    return {
        "startupProbe": {
            "httpGet": http_get,
            "periodSeconds": period_seconds,
            "timeoutSeconds": 5,
            "failureThreshold": startup_failures,
        },
        "readinessProbe": {
            "httpGet": {**http_get, "path": readiness_path},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": http_get,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def secret_env(name: str, ref: SecretKeyRef, optional: bool = False) -> dict[str, Any]:
    """An environment variable read from one Secret key."""
    selector: dict[str, Any] = {"name": ref.name, "key": ref.key}
    if optional:
        selector["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": selector}}


def api_key_env(ref: SecretKeyRef | None) -> list[dict[str, Any]]:
    """:data:`contract.API_KEY_ENV` from the endpoint's Secret, when one is configured."""
    return [] if ref is None else [secret_env(contract.API_KEY_ENV, ref)]


def container_resources(
    requests: Mapping[str, str],
    limits: Mapping[str, str],
    gpus: int = 0,
    extra_memory_bytes: int = 0,
) -> dict[str, Any]:
    """Requests and limits, with GPUs and memory the runtime will pin for KV tiers.

    ``extra_memory_bytes`` (HiCache host memory plus what a pod lends the Mooncake store) is
    added to the memory request and, when one is set, to the memory limit: those bytes are
    allocated at start-up, so the scheduler must count them.
    """
    out_requests = dict(requests)
    out_limits = dict(limits)
    if extra_memory_bytes:
        base = parse_quantity(out_requests.get("memory", "0"))
        out_requests["memory"] = format_bytes(base + Decimal(extra_memory_bytes))
        if "memory" in out_limits:
            limit = parse_quantity(out_limits["memory"]) + Decimal(extra_memory_bytes)
            out_limits["memory"] = format_bytes(limit)
    if gpus:
        out_requests[GPU_RESOURCE] = str(gpus)
        out_limits[GPU_RESOURCE] = str(gpus)
    resources: dict[str, Any] = {}
    if out_requests:
        resources["requests"] = dict(sorted(out_requests.items()))
    if out_limits:
        resources["limits"] = dict(sorted(out_limits.items()))
    return resources


def empty_dir(name: str, size_limit: str | None = None, medium: str = "") -> dict[str, Any]:
    """An emptyDir volume (``medium="Memory"`` for tmpfs)."""
    spec: dict[str, Any] = {}
    if medium:
        spec["medium"] = medium
    if size_limit:
        spec["sizeLimit"] = size_limit
    return {"name": name, "emptyDir": spec}


def container_ports(ports: Mapping[str, int], host_network: bool) -> list[dict[str, Any]]:
    """Named container ports; on the host network each is also the host port it binds."""
    out = []
    for name, port in ports.items():
        entry: dict[str, Any] = {"name": name, "containerPort": port}
        if host_network:
            entry["hostPort"] = port
        out.append(entry)
    return out


def apply_pod_settings(spec: dict[str, Any], pods: PodSettings) -> dict[str, Any]:
    """Add a role's scheduling, network and volume settings to its pod ``spec``.

    A host-network pod resolves cluster names through ``ClusterFirstWithHostNet`` (the
    default policy would give it the node's resolver).
    """
    if pods.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if pods.node_selector:
        spec["nodeSelector"] = dict(pods.node_selector)
    if pods.tolerations:
        spec["tolerations"] = [dict(t) for t in pods.tolerations]
    if pods.volumes:
        spec["volumes"] = [*spec.get("volumes", []), *(dict(v) for v in pods.volumes)]
    return spec


def user_mounts(pods: PodSettings) -> list[dict[str, Any]]:
    """The role's own ``volumeMounts``."""
    return [dict(m) for m in pods.volume_mounts]
