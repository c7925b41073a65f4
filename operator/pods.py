"""Pod templates: runtime workers (``kvflow serve``) and the router (``kvflow router``).

Commands come from :mod:`kvflow.contract`, never from string literals, so the operator
and the runtime cannot disagree about flags, ports or paths; what each role runs comes from
:mod:`.roles`, where it runs from the cluster placement of :mod:`.placement`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow import contract

from . import names
from .internal_key import internal_key_env
from .lora import cluster_adapter_storage
from .paths import CACHE_DIR, HF_HOME_ENV, MODEL_DIR, SHM_DIR, TMP_DIR
from .placement import (
    cluster_router_placement,
    cluster_worker_placement,
    router_options,
    serve_options,
)
from .podparts import (
    API_PORT_NAME,
    BOOTSTRAP_PORT_NAME,
    DIST_INIT_PORT_NAME,
    POD_IP_FIELD,
    api_key_env,
    apply_pod_settings,
    container_ports,
    container_resources,
    container_security_context,
    empty_dir,
    http_probes,
    pod_security_context,
    secret_env,
    user_mounts,
)
from .roles import router_runtime, uses_hicache, worker_runtime
from .spec import ModelDeployment, WorkerRole
from .stores import shared_store

SHM_SIZE = "1Gi"  # /dev/shm for the runtime's worker processes
CONFIG_VOLUME = "config"
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
        env = [{"name": HF_HOME_ENV, "value": f"{CACHE_DIR}/huggingface"}]
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


def worker_serve_options(
    md: ModelDeployment, worker: WorkerRole, model_path: str
) -> contract.ServeOptions:
    """The ``kvflow serve`` options of one worker role's pods."""
    placement = cluster_worker_placement(md, worker, model_path)
    return serve_options(worker_runtime(md, worker), placement)


def _pod_spec(md: ModelDeployment, containers: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {"securityContext": pod_security_context(), "containers": containers}
    if md.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": secret} for secret in md.image_pull_secrets]
    return spec


def worker_pod_template(
    md: ModelDeployment, worker: WorkerRole, config_hash: str
) -> dict[str, Any]:
    """The pod template of one runtime role's Deployment (the LoRA adapter *list* is not in
    it: a list change reaches running pods through their annotation, see ``lora.py``)."""
    mount = model_mount(md)
    adapters = cluster_adapter_storage(md)
    ports = {API_PORT_NAME: worker.http_port}
    annotations = {
        names.ANNOTATION_CONFIG_HASH: config_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(worker.http_port),
        "prometheus.io/path": contract.METRICS_PATH,
    }
    if worker.role == "prefill":
        ports[BOOTSTRAP_PORT_NAME] = md.kv_transfer.bootstrap_port
        annotations[names.ANNOTATION_BOOTSTRAP_PORT] = str(md.kv_transfer.bootstrap_port)
    if worker.spans_nodes:  # the group's leader listens there (leaderworkerset.py)
        ports[DIST_INIT_PORT_NAME] = contract.DIST_INIT_PORT
    env: list[dict[str, Any]] = [
        POD_IP_FIELD,
        {"name": contract.MODEL_CACHE_ENV, "value": CACHE_DIR},
        {"name": HF_HOME_ENV, "value": f"{CACHE_DIR}/huggingface"},
        *api_key_env(md.endpoint.api_key),
        *internal_key_env(md),
    ]
    config_dir = contract.RUNTIME_CONFIG_DIR
    tiered = uses_hicache(md, worker)
    store = shared_store(md) if tiered else None  # only tiered workers are store clients
    if store is not None:
        client_env = store.cluster_client().env(config_dir)
        env += [{"name": name, "value": value} for name, value in client_env.items()]
    env += [dict(e) for e in worker.pods.env]
    volumes = [
        empty_dir("cache"),
        empty_dir("tmp"),
        empty_dir("shm", SHM_SIZE, medium="Memory"),
        {"name": CONFIG_VOLUME, "configMap": {"name": names.child_name(md.name, "runtime")}},
        *mount.volumes,
        *adapters.volumes,
    ]
    mounts = [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "shm", "mountPath": SHM_DIR},
        {"name": CONFIG_VOLUME, "mountPath": config_dir, "readOnly": True},
        *mount.mounts,
        *adapters.mounts,
    ]
    extra_memory = md.hicache.host_memory_bytes if tiered else 0
    if store is not None:
        store_volumes, store_mounts = store.worker_volumes()
        volumes += store_volumes
        mounts += store_mounts
        extra_memory += store.lent_memory_bytes()
    mounts += user_mounts(worker.pods)
    rdma = ("IPC_LOCK",) if md.kv_transfer.protocol == "rdma" else ()
    container = {
        "name": "runtime",
        "image": md.worker_image(worker),
        "imagePullPolicy": md.image_pull_policy,
        "command": contract.serve_argv(worker_serve_options(md, worker, mount.model_path)),
        "ports": container_ports(ports, worker.pods.host_network),
        "env": env,
        "resources": container_resources(
            worker.pods.requests, worker.pods.limits, worker.gpus, extra_memory
        ),
        "securityContext": container_security_context(rdma),
        "volumeMounts": mounts,
        # A container that exits (a refused flag, say) leaves its last log lines in its
        # status, where the ModelDeployment's Degraded condition quotes them.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **http_probes(worker.startup_timeout_seconds),
    }
    spec = _pod_spec(md, [container])
    spec.update(
        automountServiceAccountToken=False,
        terminationGracePeriodSeconds=60,
        volumes=volumes,
    )
    if mount.init_containers or adapters.init_containers:
        spec["initContainers"] = [*mount.init_containers, *adapters.init_containers]
    apply_pod_settings(spec, worker.pods)
    return {
        "metadata": {"labels": names.labels(md.name, worker.role), "annotations": annotations},
        "spec": spec,
    }


def router_pod_template(md: ModelDeployment) -> dict[str, Any]:
    """The router's pod template: discovers workers by label through the Kubernetes API."""
    router = md.router
    argv = contract.router_argv(router_options(router_runtime(md), cluster_router_placement(md)))
    container = {
        "name": "router",
        "image": router.image,
        "imagePullPolicy": md.image_pull_policy,
        "command": argv,
        "ports": container_ports({API_PORT_NAME: router.http_port}, router.pods.host_network),
        "env": [
            # a host-network router binds its pod IP (see placement.POD_IP)
            *([POD_IP_FIELD] if router.pods.host_network else []),
            *api_key_env(md.endpoint.api_key),
            *internal_key_env(md),
            *(dict(e) for e in router.pods.env),
        ],
        "resources": container_resources(router.pods.requests, router.pods.limits),
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_DIR}, *user_mounts(router.pods)],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Ready only while the router has a healthy worker of every role it needs.
        **http_probes(
            ROUTER_STARTUP_TIMEOUT_SECONDS,
            period_seconds=2,
            readiness_path=contract.ROUTER_READINESS_PATH,
        ),
    }
    spec = _pod_spec(md, [container])
    spec.update(
        serviceAccountName=names.child_name(md.name, names.ROUTER),
        terminationGracePeriodSeconds=30,
        volumes=[empty_dir("tmp")],
    )
    apply_pod_settings(spec, router.pods)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(router.http_port),
        "prometheus.io/path": contract.METRICS_PATH,
    }
    return {
        "metadata": {"labels": names.labels(md.name, names.ROUTER), "annotations": annotations},
        "spec": spec,
    }
