"""Where each role runs and how peers reach each other, and the join with what it runs.

A placement says where a process listens, where it finds the weights and the file store,
and how it addresses its peers. :func:`serve_options` / :func:`router_options` /
:func:`master_argv` join a role's runtime options (:mod:`.roles`) with a placement into
the command it runs: the operator with a cluster placement (this module's ``cluster_*``:
all interfaces, the spec's ports, ``/models``, Service DNS names, discovery through the
API), ``kvflow up`` with a local one (loopback, free ports, local paths, static URLs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow import contract

from . import names
from .paths import HICACHE_DIR
from .roles import RouterRuntime, WorkerRuntime
from .spec import ModelDeployment, WorkerRole

MOONCAKE_LOCAL_BUFFER = 512 * 2**20  # staging buffer of each Mooncake store client
ALL_INTERFACES = "0.0.0.0"
# A host-network pod binds its own IP (the node's), not every interface of the node; the
# kubelet expands $(VAR) in a container's command from its environment.
POD_IP = f"$({contract.POD_IP_ENV})"


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


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker process listens and finds its files and the shared store."""

    host: str
    port: int
    model_path: str  # "" means the embedded model
    bootstrap_port: int | None = None  # prefill role only
    file_store_dir: str = HICACHE_DIR  # the file store's directory (file store only)
    master: MasterPlacement | None = None  # the Mooncake master (mooncake store only)


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


def serve_options(runtime: WorkerRuntime, placement: WorkerPlacement) -> contract.ServeOptions:
    """A worker's ``kvflow serve`` options: its runtime options at its placement."""
    storage_path = None
    if runtime.hicache_storage == "file":
        storage_path = placement.file_store_dir
    elif runtime.hicache_storage == "mooncake":
        if placement.master is None:
            raise ValueError("a Mooncake store needs the master's placement")
        storage_path = placement.master.rpc_address
    hicache = None
    if runtime.hicache_host_memory_gb is not None:
        hicache = contract.HiCacheOptions(
            host_memory_gb=runtime.hicache_host_memory_gb,
            write_policy=runtime.hicache_write_policy or contract.HiCacheOptions.write_policy,
            storage=runtime.hicache_storage or contract.NO_STORAGE,
            storage_path=storage_path or "",
        )
    return contract.ServeOptions(
        model_path=placement.model_path,
        served_model_name=runtime.served_model_name,
        role=runtime.role,
        host=placement.host,
        port=placement.port,
        bootstrap_port=placement.bootstrap_port if runtime.role == "prefill" else None,
        kv_transfer_protocol=runtime.kv_transfer_protocol,
        hicache=hicache,
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
        extra_args=runtime.extra_args,
    )


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


def mooncake_client_config(
    master: MasterPlacement, segment_bytes: int, protocol: str
) -> dict[str, Any]:
    """Mooncake store client settings (``$KVFLOW_MOONCAKE_CONFIG``); ``local_hostname`` is
    left empty for the runtime to fill from ``$KVFLOW_POD_IP``."""
    return {
        "local_hostname": "",
        "metadata_server": master.metadata_url,
        "master_server_address": master.rpc_address,
        "global_segment_size": segment_bytes,
        "local_buffer_size": MOONCAKE_LOCAL_BUFFER,
        "protocol": protocol,
        "device_name": "",
    }


# -- cluster placement (the operator's) ---------------------------------------------------


def cluster_master(md: ModelDeployment) -> MasterPlacement:
    """The master as pods reach it: ``spec.mooncakeMaster.host``, else its Service's name.
    On the host network it binds its pod IP (the node's), with the metadata server as a
    process of its own (the built-in one would bind every interface of the node); else
    every interface of its pod."""
    master = md.mooncake_master
    service = f"{names.child_name(md.name, names.MOONCAKE_MASTER)}.{md.namespace}.svc"
    return MasterPlacement(
        host=master.host or service,
        rpc_port=master.rpc_port,
        metadata_port=master.metadata_port,
        metrics_port=master.metrics_port,
        bind_host=POD_IP if master.pods.host_network else None,
        separate_metadata_server=master.pods.host_network,
    )


def cluster_worker_placement(
    md: ModelDeployment, worker: WorkerRole, model_path: str
) -> WorkerPlacement:
    """A worker pod: every interface, the role's port, weights at ``model_path``."""
    return WorkerPlacement(
        host=POD_IP if worker.pods.host_network else ALL_INTERFACES,
        port=worker.http_port,
        model_path=model_path,
        bootstrap_port=md.kv_transfer.bootstrap_port if worker.role == "prefill" else None,
        file_store_dir=HICACHE_DIR,
        master=cluster_master(md) if md.hicache.store == "mooncake" else None,
    )


def router_selector(md: ModelDeployment) -> str:
    """Label selector the router uses to discover this deployment's workers."""
    roles = ",".join(worker.role for worker in md.workers)
    return f"{names.LABEL_DEPLOYMENT}={md.name},{names.LABEL_ROLE} in ({roles})"


def cluster_router_placement(md: ModelDeployment) -> RouterPlacement:
    """The router pod: every interface, its port, workers discovered through the API."""
    return RouterPlacement(
        host=POD_IP if md.router.pods.host_network else ALL_INTERFACES,
        port=md.router.http_port,
        discover_namespace=md.namespace,
        discover_selector=router_selector(md),
    )
