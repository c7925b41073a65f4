"""Where each role runs and how peers reach each other, and the join with what it runs.

A placement says where a process listens, where it finds the weights and the shared store,
and how it addresses its peers. :func:`serve_options` / :func:`router_options` join a
role's runtime options (:mod:`.roles`) with a placement into the command it runs: the
operator with a cluster placement (this module's ``cluster_*``: all interfaces, the spec's
ports, ``/models``, Service DNS names, discovery through the API), ``kvflow up`` with a
local one (loopback, free ports, local paths, static URLs). Where the shared store is comes
from the store (:mod:`.stores`), which places its own processes too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvflow import contract

from . import lwsapi, names
from .roles import RouterRuntime, WorkerRuntime
from .spec import ModelDeployment, WorkerRole
from .stores import shared_store

ALL_INTERFACES = "0.0.0.0"
# A host-network pod binds its own IP (the node's), not every interface of the node; the
# kubelet expands $(VAR) in a container's command from its environment.
POD_IP = f"$({contract.POD_IP_ENV})"


@dataclass(frozen=True)
class NodePlacement:
    """One tensor-parallel group over ``count`` pods: this pod's node rank and the leader's
    meeting address (``$(VAR)`` references the kubelet expands, see :mod:`.lwsapi`)."""

    count: int
    rank: str
    init_addr: str


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker process listens and finds its files and the shared store."""

    host: str
    port: int
    model_path: str  # "" means the embedded model
    bootstrap_port: int | None = None  # prefill role only
    storage_path: str = ""  # where the shared store is (StoreClient.storage_path)
    nodes: NodePlacement | None = None  # None: the whole group in one pod


@dataclass(frozen=True)
class RouterPlacement:
    """Where the router listens and how it finds workers: static URLs or discovery."""

    host: str
    port: int
    worker_urls: Sequence[str] = ()
    prefill_urls: Sequence[str] = ()  # each "URL#BOOTSTRAP_PORT"
    decode_urls: Sequence[str] = ()
    discover_namespace: str | None = None
    discover_selector: str | None = None
    lora_adapters: Mapping[str, str] = field(default_factory=dict)  # static workers' adapters


def serve_options(runtime: WorkerRuntime, placement: WorkerPlacement) -> contract.ServeOptions:
    """A worker's ``kvflow serve`` options: its runtime options at its placement."""
    hicache = runtime.hicache
    if hicache is not None and hicache.storage != contract.NO_STORAGE:
        if not placement.storage_path:
            raise ValueError(f"a {hicache.storage} store needs its place (storage_path)")
        hicache = replace(hicache, storage_path=placement.storage_path)
    return contract.ServeOptions(
        model_path=placement.model_path,
        served_model_name=runtime.served_model_name,
        role=runtime.role,
        host=placement.host,
        port=placement.port,
        bootstrap_port=placement.bootstrap_port if runtime.role == "prefill" else None,
        kv_transfer_protocol=runtime.kv_transfer_protocol,
        kv_transfer_backend=runtime.kv_transfer_backend,
        tp_size=runtime.tp_size,
        dp_size=runtime.dp_size,
        nnodes=placement.nodes.count if placement.nodes is not None else None,
        node_rank=placement.nodes.rank if placement.nodes is not None else None,
        dist_init_addr=placement.nodes.init_addr if placement.nodes is not None else None,
        hicache=hicache,
        lora=runtime.lora,
        max_running_requests=runtime.max_running_requests,
        extra_args=runtime.extra_args,
    )


def router_options(runtime: RouterRuntime, placement: RouterPlacement) -> contract.RouterOptions:
    """The router's ``kvflow router`` options: its runtime options at its placement."""
    return contract.RouterOptions(
        policy=runtime.policy,
        host=placement.host,
        port=placement.port,
        worker_urls=tuple(placement.worker_urls),
        prefill_urls=tuple(placement.prefill_urls),
        decode_urls=tuple(placement.decode_urls),
        discover_namespace=placement.discover_namespace,
        discover_selector=placement.discover_selector,
        lora_adapters=dict(placement.lora_adapters),
        extra_args=runtime.extra_args,
    )


# -- cluster placement (the operator's) ---------------------------------------------------


def cluster_worker_placement(
    md: ModelDeployment, worker: WorkerRole, model_path: str
) -> WorkerPlacement:
    """A worker pod: every interface, the role's port, weights at ``model_path``."""
    store = shared_store(md)
    return WorkerPlacement(
        host=POD_IP if worker.pods.host_network else ALL_INTERFACES,
        port=worker.http_port,
        model_path=model_path,
        bootstrap_port=md.kv_transfer.bootstrap_port if worker.role == "prefill" else None,
        storage_path=store.cluster_client().storage_path if store is not None else "",
        nodes=cluster_node_placement(worker),
    )


def cluster_node_placement(worker: WorkerRole) -> NodePlacement | None:
    """A role over several nodes: each pod of a LeaderWorkerSet group is one node, its rank
    the pod's index in the group, the meeting point its leader's DNS name."""
    if not worker.spans_nodes:
        return None
    leader = f"$({lwsapi.LEADER_ADDRESS_ENV}):{contract.DIST_INIT_PORT}"
    return NodePlacement(worker.nodes_per_replica, f"$({lwsapi.WORKER_INDEX_ENV})", leader)


def router_selector(md: ModelDeployment) -> str:
    """Label selector the router uses to discover this deployment's workers (of a role over
    several nodes, the leaders: the other pods serve no HTTP)."""
    roles = ",".join(worker.role for worker in md.workers)
    selector = f"{names.LABEL_DEPLOYMENT}={md.name},{names.LABEL_ROLE} in ({roles})"
    if any(worker.spans_nodes for worker in md.workers):
        selector += f",{names.LABEL_NODE}!={names.NODE_WORKER}"
    return selector


def cluster_router_placement(md: ModelDeployment) -> RouterPlacement:
    """The router pod: every interface, its port, workers discovered through the API."""
    return RouterPlacement(
        host=POD_IP if md.router.pods.host_network else ALL_INTERFACES,
        port=md.router.http_port,
        discover_namespace=md.namespace,
        discover_selector=router_selector(md),
    )
