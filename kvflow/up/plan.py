"""A ModelDeployment placed on this machine: the processes ``kvflow up`` starts (pure).

The operator's own parser reads the file and its own role builders decide what each role
runs (:mod:`kvflow.operator.roles`); this module only places them locally: every process on
127.0.0.1 with its own port, the embedded model or a local folder, the router given the
workers' URLs. The shared store places itself (:meth:`SharedStore.local`: the file store in
a directory, the Mooncake master and its HTTP metadata server as processes). What the
operator would do that has no local meaning (scheduling, images, Services) is listed as not
applied; what would change the behaviour and cannot be done here is refused.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow import contract
from kvflow.operator.internal_key import new_internal_key
from kvflow.operator.lora import local_adapter_paths
from kvflow.operator.placement import (
    RouterPlacement,
    WorkerPlacement,
    router_options,
    serve_options,
)
from kvflow.operator.roles import router_runtime, worker_runtime
from kvflow.operator.sizes import desired_sizes
from kvflow.operator.spec import ModelDeployment, PodSettings
from kvflow.operator.stores import SharedStore, StoreClient, shared_store

LOOPBACK = "127.0.0.1"
STORE_START_TIMEOUT_S = 60.0


class LocalRefusal(ValueError):
    """Fields of the spec ``kvflow up`` cannot honour on this machine, one line each."""

    def __init__(self, reasons: Sequence[str]) -> None:
        super().__init__("\n".join(reasons))
        self.reasons = list(reasons)


@dataclass(frozen=True)
class Health:
    """How to tell a process is serving: an HTTP path answering 200, or a TCP port open."""

    port: int
    path: str | None = None  # None: a TCP connect is enough

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}{self.path or ''}"


@dataclass(frozen=True)
class LocalProcess:
    """One process of the topology: its name (log prefix), command, environment, health."""

    name: str
    argv: list[str]
    env: Mapping[str, str]
    health: Health
    start_timeout_s: float
    stage: int  # started after every process of a lower stage is healthy


@dataclass(frozen=True)
class LocalPlan:
    """Everything ``kvflow up`` starts, and what it reports."""

    processes: list[LocalProcess]
    endpoint: str  # the router's base URL
    api_key: str | None
    not_applied: list[str] = field(default_factory=list)  # cluster-only fields that are set


def _kvflow(argv: Sequence[str]) -> list[str]:
    """A contract command (``kvflow serve ...``) run with this interpreter."""
    assert argv[0] == "kvflow"
    return [sys.executable, "-P", "-m", "kvflow", *argv[1:]]


def _env_values(pods: PodSettings, path: str, refusals: list[str]) -> dict[str, str]:
    values = {}
    for entry in pods.env:
        if "valueFrom" in entry:
            refusals.append(
                f"{path}.env[{entry['name']}]: valueFrom reads the cluster (Secrets, the "
                "downward API); give a value"
            )
        else:
            values[str(entry["name"])] = str(entry.get("value", ""))
    return values


def _pod_refusals(pods: PodSettings, path: str, refusals: list[str]) -> None:
    if pods.volumes or pods.volume_mounts:
        refusals.append(
            f"{path}.volumes/volumeMounts: Kubernetes volumes cannot be mounted locally"
        )


def _set(spec: Mapping[str, Any], dotted: str) -> bool:
    """Whether the field at ``dotted`` (under ``spec``) has a value."""
    value: Any = spec
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return bool(value)


def _cluster_only(
    md: ModelDeployment, store: SharedStore | None, body: Mapping[str, Any]
) -> list[str]:
    """Set fields that place pods in a cluster and mean nothing for local processes."""
    spec = body.get("spec") or {}
    found = [
        key
        for key in ("image", "imagePullPolicy", "imagePullSecrets", "networkPolicy")
        if key in spec
    ]
    if "serviceType" in (spec.get("endpoint") or {}):
        found.append("endpoint.serviceType")
    store_pods = list(store.pod_settings()) if store is not None else []
    roles = [w.role for w in md.workers] + ["router", *store_pods]
    for role in roles:
        raw = spec.get(role) or {}
        for key in ("resources", "nodeSelector", "tolerations", "image", "hostNetwork", "ports"):
            if key in raw:
                found.append(f"{role}.{key}")
    if md.router.replicas > 1:
        found.append("router.replicas (one local router)")
    found += [f for f in (store.cluster_only_fields if store is not None else ()) if _set(spec, f)]
    if "bootstrapPort" in (spec.get("kvTransfer") or {}):
        found.append("kvTransfer.bootstrapPort")
    return found


def local_gpu_count() -> int:
    """NVIDIA GPUs this machine has (the driver's own listing; no torch)."""
    listing = Path("/proc/driver/nvidia/gpus")
    return len(list(listing.iterdir())) if listing.is_dir() else 0


def _refusals(
    md: ModelDeployment,
    store: SharedStore | None,
    secrets: Mapping[str, Mapping[str, str]],
    gpus_here: int,
) -> list[str]:
    refusals: list[str] = []
    source = md.model.source
    if source in ("pvc", "huggingFace"):
        hint = (
            "a local folder: model.source hostPath"
            if source == "pvc"
            else "hf download, then hostPath"
        )
        refusals.append(f"spec.model.source {source}: not reachable locally (use {hint})")
    if source == "hostPath" and not Path(md.model.host_path).is_dir():
        refusals.append(f"spec.model.hostPath.path: {md.model.host_path} is not a folder here")
    for i, adapter in enumerate(md.lora.adapters if md.lora is not None else ()):
        path = f"spec.lora.adapters[{i}]"
        if adapter.source.source != "hostPath":
            refusals.append(f"{path}.source {adapter.source.source}: not reachable locally "
                            "(a local folder: source hostPath)")  # fmt: skip
        elif not Path(adapter.source.host_path).is_dir():
            refusals.append(
                f"{path}.hostPath.path: {adapter.source.host_path} is not a folder here"
            )
    sizes = desired_sizes(md)
    gpus = sum(w.gpus * sizes[w.role] for w in md.workers)
    if gpus > gpus_here:
        refusals.append(f"spec.*.gpus: {gpus} GPUs asked, {gpus_here} on this machine")
    for worker in md.workers:
        path = f"spec.{worker.role}"
        if worker.spans_nodes:
            refusals.append(
                f"{path}.nodesPerReplica {worker.nodes_per_replica}: kvflow up runs one "
                "machine (in a cluster the operator renders a LeaderWorkerSet; by hand, "
                "--nnodes: docs/parallelism.md)"
            )
        if worker.autoscaling.enabled:
            refusals.append(
                f"{path}.autoscaling.enabled: kvflow up runs fixed replicas (no autoscaler); "
                "set replicas and turn autoscaling off"
            )
        _pod_refusals(worker.pods, path, refusals)
    _pod_refusals(md.router.pods, "spec.router", refusals)
    if store is not None:
        for section, pods in store.pod_settings().items():
            _pod_refusals(pods, f"spec.{section}", refusals)
        refusals += store.local_refusals(_which)
    if md.kv_transfer.protocol == "rdma" and not Path("/sys/class/infiniband").is_dir():
        refusals.append("spec.kvTransfer.protocol rdma: this machine has no RDMA device")
    ref = md.endpoint.api_key
    if ref is not None and ref.key not in secrets.get(ref.name, {}):
        refusals.append(
            f"spec.endpoint.apiKeySecretRef: put the Secret {ref.name!r} (key {ref.key!r}) "
            "in the same file"
        )
    return refusals


def _which(binary: str) -> str | None:
    """``binary`` on PATH or in this interpreter's folder (a venv's console scripts)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which(binary, path=path)


def local_plan(
    md: ModelDeployment,
    body: Mapping[str, Any],
    secrets: Mapping[str, Mapping[str, str]],
    state_dir: Path,
    router_port: int,
    free_port: Callable[[], int],
    gpus_here: int = 0,
) -> LocalPlan:
    """Place ``md`` on this machine; raises :class:`LocalRefusal` listing what cannot be.

    ``free_port`` hands out unused loopback ports (one call per port); ``state_dir`` holds
    the shared store's files and the logs.
    """
    store = shared_store(md)
    refusals = _refusals(md, store, secrets, gpus_here)
    env_by_role = {w.role: _env_values(w.pods, f"spec.{w.role}", refusals) for w in md.workers}
    router_env = _env_values(md.router.pods, "spec.router", refusals)
    store_env = {
        section: _env_values(pods, f"spec.{section}", refusals)
        for section, pods in (store.pod_settings() if store is not None else {}).items()
    }
    if refusals:
        raise LocalRefusal(refusals)

    api_key = None
    if md.endpoint.api_key is not None:
        api_key = secrets[md.endpoint.api_key.name][md.endpoint.api_key.key]
    base_env = {contract.POD_IP_ENV: LOOPBACK, "PYTHONUNBUFFERED": "1"}
    if api_key:
        base_env[contract.API_KEY_ENV] = api_key
    if md.disaggregated:  # a fresh internal key per run: router and workers share it
        base_env[contract.INTERNAL_KEY_ENV] = new_internal_key()
    processes: list[LocalProcess] = []
    client = StoreClient("")
    if store is not None:
        local = store.local(state_dir, free_port)
        client = local.client
        for name, text in client.files.items():
            (state_dir / name).write_text(text)
        base_env.update(client.env(str(state_dir)))
        for process in local.processes:
            argv = [_which(process.argv[0]) or process.argv[0], *process.argv[1:]]
            env = store_env[process.pods]
            health = Health(process.port)
            processes.append(
                LocalProcess(process.name, argv, env, health, STORE_START_TIMEOUT_S, stage=0)
            )
    model_path = md.model.host_path if md.model.source == "hostPath" else ""

    urls: dict[str, list[str]] = {"unified": [], "prefill": [], "decode": []}
    gpu_next = 0
    sizes = desired_sizes(md)
    for worker in md.workers:
        runtime = worker_runtime(md, worker)
        for index in range(sizes[worker.role]):
            port = free_port()
            bootstrap = free_port() if worker.role == "prefill" else None
            placement = WorkerPlacement(
                host=LOOPBACK,
                port=port,
                model_path=model_path,
                bootstrap_port=bootstrap,
                storage_path=client.storage_path,
            )
            env = {**base_env, **env_by_role[worker.role]}
            if worker.gpus:
                devices = range(gpu_next, gpu_next + worker.gpus)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
                gpu_next += worker.gpus
            url = f"http://{LOOPBACK}:{port}"
            urls[worker.role].append(f"{url}#{bootstrap}" if bootstrap else url)
            argv = contract.serve_argv(serve_options(runtime, placement))
            processes.append(
                LocalProcess(
                    f"{worker.role}-{index}",
                    _kvflow(argv),
                    env,
                    Health(port, contract.HEALTH_PATH),
                    float(worker.startup_timeout_seconds),
                    stage=1,
                )
            )
    router_placement = RouterPlacement(
        host=LOOPBACK,
        port=router_port,
        worker_urls=urls["unified"],
        prefill_urls=urls["prefill"],
        decode_urls=urls["decode"],
        # the router loads them into every worker, as it does in a cluster
        lora_adapters=local_adapter_paths(md),
    )
    router_argv = contract.router_argv(router_options(router_runtime(md), router_placement))
    processes.append(
        LocalProcess(
            "router",
            _kvflow(router_argv),
            {**base_env, **router_env},
            Health(router_port, contract.ROUTER_READINESS_PATH),
            60.0,
            stage=2,
        )
    )
    return LocalPlan(
        processes=processes,
        endpoint=f"http://{LOOPBACK}:{router_port}",
        api_key=api_key,
        not_applied=_cluster_only(md, store, body),
    )
