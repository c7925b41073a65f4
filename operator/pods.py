"""Pod templates: runtime workers (``kvflow serve``) and the router (``kvflow router``).

Commands come from :mod:`kvflow.contract`, never from string literals, so the operator
and the runtime cannot disagree about flags, ports or paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow import contract

from . import names
from .podparts import (
    API_PORT_NAME,
    BOOTSTRAP_PORT_NAME,
    api_key_env,
    container_resources,
    container_security_context,
    empty_dir,
    http_probes,
    pod_security_context,
    secret_env,
)
from .spec import ModelDeployment, WorkerRole

CACHE_DIR = "/var/cache/kvflow"  # converted/embedded models, Hugging Face cache
MODEL_DIR = "/models"
HICACHE_DIR = "/var/lib/kvflow/hicache"
SHM_SIZE = "1Gi"  # /dev/shm for the runtime's worker processes
CONFIG_VOLUME = "config"
MOONCAKE_CONFIG_FILE = "mooncake.json"
ROUTER_STARTUP_TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class ModelMount:
    """How a pod reaches the weights: ``--model-path`` plus volumes and an init container."""

    model_path: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_mount(md: ModelDeployment) -> ModelMount:
    """Volumes for ``spec.model``; the embedded model needs none (it ships in the image)."""
    model = md.model
    read_only_mount = [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}]
    if model.source == "pvc":
        path = f"{MODEL_DIR}/{model.claim_path}".rstrip("/") if model.claim_path else MODEL_DIR
        volume = {"persistentVolumeClaim": {"claimName": model.claim_name, "readOnly": True}}
        return ModelMount(path, [{"name": "model", **volume}], read_only_mount)
    if model.source == "hostPath":
        volume = {"hostPath": {"path": model.host_path, "type": "Directory"}}
        return ModelMount(MODEL_DIR, [{"name": "model", **volume}], read_only_mount)
    if model.source == "huggingFace":
        env = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}]
        if model.hf_token is not None:
            env.append(secret_env("HF_TOKEN", model.hf_token))
        fetch = {
            "name": "fetch-model",
            "image": md.image,
            "imagePullPolicy": md.image_pull_policy,
            "command": [
                "hf",
                "download",
                model.hf_id,
                "--revision",
                model.hf_revision,
                "--local-dir",
                MODEL_DIR,
            ],
            "env": env,
            "securityContext": container_security_context(),
            "volumeMounts": [
                {"name": "model", "mountPath": MODEL_DIR},
                {"name": "cache", "mountPath": CACHE_DIR},
            ],
        }
        return ModelMount(MODEL_DIR, [empty_dir("model")], read_only_mount, [fetch])
    return ModelMount("")


def mooncake_master_address(md: ModelDeployment) -> str:
    """``host:port`` of the deployment's Mooncake master RPC endpoint."""
    host = f"{names.child_name(md.name, names.MOONCAKE_MASTER)}.{md.namespace}.svc"
    return f"{host}:{contract.MOONCAKE_MASTER_RPC_PORT}"


def serve_options(
    md: ModelDeployment, worker: WorkerRole, model_path: str
) -> contract.ServeOptions:
    """The runtime flags of one worker role, decided from the spec."""
    hicache = md.hicache
    storage_path = {"file": HICACHE_DIR, "mooncake": mooncake_master_address(md)}
    needs_transfer = md.disaggregated or hicache.store == "mooncake"
    return contract.ServeOptions(
        model_path=model_path,
        served_model_name=md.model.served_model_name,
        role=worker.role,
        port=contract.DEFAULT_API_PORT,
        bootstrap_port=md.kv_transfer.bootstrap_port if worker.role == "prefill" else None,
        kv_transfer_protocol=md.kv_transfer.protocol if needs_transfer else None,
        hicache_host_memory_gb=hicache.host_memory_bytes / 2**30 if hicache.enabled else None,
        hicache_write_policy=hicache.write_policy if hicache.enabled else None,
        hicache_storage=hicache.store if hicache.store != "none" else None,
        hicache_storage_path=storage_path.get(hicache.store),
        max_running_requests=worker.max_running_requests,
        extra_args=tuple(worker.pods.extra_args),
    )


def _pod_spec(md: ModelDeployment, containers: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {"securityContext": pod_security_context(), "containers": containers}
    if md.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": secret} for secret in md.image_pull_secrets]
    return spec


def worker_pod_template(
    md: ModelDeployment, worker: WorkerRole, config_hash: str
) -> dict[str, Any]:
    """The pod template of one runtime role's Deployment."""
    mount = model_mount(md)
    ports = [{"name": API_PORT_NAME, "containerPort": contract.DEFAULT_API_PORT}]
    annotations = {
        names.ANNOTATION_CONFIG_HASH: config_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(contract.DEFAULT_API_PORT),
        "prometheus.io/path": contract.METRICS_PATH,
    }
    if worker.role == "prefill":
        ports.append({"name": BOOTSTRAP_PORT_NAME, "containerPort": md.kv_transfer.bootstrap_port})
        annotations[names.ANNOTATION_BOOTSTRAP_PORT] = str(md.kv_transfer.bootstrap_port)
    env: list[dict[str, Any]] = [
        {"name": contract.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": contract.MODEL_CACHE_ENV, "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        *api_key_env(md.endpoint.api_key),
    ]
    config_dir = contract.RUNTIME_CONFIG_DIR
    if md.hicache.store == "mooncake":
        env.append(
            {"name": contract.MOONCAKE_CONFIG_ENV, "value": f"{config_dir}/{MOONCAKE_CONFIG_FILE}"}
        )
    env += [dict(e) for e in worker.pods.env]
    volumes = [
        empty_dir("cache"),
        empty_dir("tmp"),
        empty_dir("shm", SHM_SIZE, medium="Memory"),
        {"name": CONFIG_VOLUME, "configMap": {"name": names.child_name(md.name, "runtime")}},
        *mount.volumes,
    ]
    mounts = [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": CONFIG_VOLUME, "mountPath": config_dir, "readOnly": True},
        *mount.mounts,
    ]
    if md.hicache.store == "file":
        claim = names.child_name(md.name, "hicache")
        volumes.append({"name": "hicache", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "hicache", "mountPath": HICACHE_DIR})
    rdma = ("IPC_LOCK",) if md.kv_transfer.protocol == "rdma" else ()
    extra_memory = md.hicache.host_memory_bytes + md.hicache.mooncake_segment_bytes
    container = {
        "name": "runtime",
        "image": md.image,
        "imagePullPolicy": md.image_pull_policy,
        "command": contract.serve_argv(serve_options(md, worker, mount.model_path)),
        "ports": ports,
        "env": env,
        "resources": container_resources(
            worker.pods.requests, worker.pods.limits, worker.gpus, extra_memory
        ),
        "securityContext": container_security_context(rdma),
        "volumeMounts": mounts,
        **http_probes(worker.startup_timeout_seconds),
    }
    spec = _pod_spec(md, [container])
    spec.update(
        automountServiceAccountToken=False,
        terminationGracePeriodSeconds=60,
        volumes=volumes,
    )
    if mount.init_containers:
        spec["initContainers"] = mount.init_containers
    if worker.pods.node_selector:
        spec["nodeSelector"] = dict(worker.pods.node_selector)
    if worker.pods.tolerations:
        spec["tolerations"] = [dict(t) for t in worker.pods.tolerations]
    return {
        "metadata": {"labels": names.labels(md.name, worker.role), "annotations": annotations},
        "spec": spec,
    }


def router_selector(md: ModelDeployment) -> str:
    """Label selector the router uses to discover this deployment's workers."""
    roles = ",".join(worker.role for worker in md.workers)
    return f"{names.LABEL_DEPLOYMENT}={md.name},{names.LABEL_ROLE} in ({roles})"


def router_pod_template(md: ModelDeployment) -> dict[str, Any]:
    """The router's pod template: discovers workers by label through the Kubernetes API."""
    router = md.router
    argv = contract.router_argv(
        contract.RouterOptions(
            policy=router.policy,
            port=contract.DEFAULT_API_PORT,
            discover_namespace=md.namespace,
            discover_selector=router_selector(md),
            extra_args=tuple(router.pods.extra_args),
        )
    )
    container = {
        "name": "router",
        "image": router.image,
        "imagePullPolicy": md.image_pull_policy,
        "command": argv,
        "ports": [{"name": API_PORT_NAME, "containerPort": contract.DEFAULT_API_PORT}],
        "env": [*api_key_env(md.endpoint.api_key), *(dict(e) for e in router.pods.env)],
        "resources": container_resources(router.pods.requests, router.pods.limits),
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        **http_probes(ROUTER_STARTUP_TIMEOUT_SECONDS, period_seconds=2),
    }
    spec = _pod_spec(md, [container])
    spec.update(
        serviceAccountName=names.child_name(md.name, names.ROUTER),
        terminationGracePeriodSeconds=30,
        volumes=[empty_dir("tmp")],
    )
    if router.pods.node_selector:
        spec["nodeSelector"] = dict(router.pods.node_selector)
    if router.pods.tolerations:
        spec["tolerations"] = [dict(t) for t in router.pods.tolerations]
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(contract.DEFAULT_API_PORT),
        "prometheus.io/path": contract.METRICS_PATH,
    }
    return {
        "metadata": {"labels": names.labels(md.name, names.ROUTER), "annotations": annotations},
        "spec": spec,
    }
