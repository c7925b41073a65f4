"""The Mooncake store: pages in memory the store clients lend, indexed by a Mooncake master.

Clients reach the master at its RPC address (``--hicache-storage-path``) and read the rest
of their settings from ``mooncake.json`` (``$KVFLOW_MOONCAKE_CONFIG``). They move pages
with the KV transfer engine, between each other's lent memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvflow import contract

from ..policies import ingress_policy, role_peers
from ..quantity import parse_quantity
from ..spec import PodSettings
from .base import LocalStore, Manifest, SharedStore, StoreClient, StoreProcess
from .mooncake_master import (
    MASTER,
    MasterPlacement,
    cluster_master,
    master_argv,
    master_deployment,
    master_service,
    metadata_server_argv,
)

DEFAULT_SEGMENT = "4Gi"  # memory each store client lends, without sharedStore.size
LOCAL_BUFFER = 512 * 2**20  # staging buffer of each store client
CONFIG_FILE = "mooncake.json"
LOOPBACK = "127.0.0.1"
PODS = "mooncakeMaster"  # the spec section of the master's pods


def client_config(master: MasterPlacement, segment_bytes: int, protocol: str) -> dict[str, Any]:
    """Mooncake store client settings (``$KVFLOW_MOONCAKE_CONFIG``); ``local_hostname`` is
    left empty for the runtime to fill from ``$KVFLOW_POD_IP``."""
    return {
        "local_hostname": "",
        "metadata_server": master.metadata_url,
        "master_server_address": master.rpc_address,
        "global_segment_size": segment_bytes,
        "local_buffer_size": LOCAL_BUFFER,
        "protocol": protocol,
        "device_name": "",
    }


class MooncakeStore(SharedStore):
    """Pages in the clients' lent memory (``spec.hiCache.sharedStore.size`` each), indexed
    by a Mooncake master (``spec.mooncakeMaster``)."""

    spec_sections = (PODS,)
    cluster_only_fields = (f"{PODS}.host",)
    pools_worker_memory = True

    def bound_ports(self) -> list[tuple[bool, dict[str, int]]]:
        master = self.md.mooncake_master
        ports = {
            "spec.mooncakeMaster.ports.rpc": master.rpc_port,
            "spec.mooncakeMaster.ports.metadata": master.metadata_port,
            "spec.mooncakeMaster.ports.metrics": master.metrics_port,
        }
        return [(master.pods.host_network, ports)]

    def lent_memory_bytes(self) -> int:
        return int(parse_quantity(self.md.hicache.store_size or DEFAULT_SEGMENT))

    def _client(self, master: MasterPlacement) -> StoreClient:
        config = client_config(master, self.lent_memory_bytes(), self.md.kv_transfer.protocol)
        return StoreClient(
            storage_path=master.rpc_address,
            files={CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)},
            file_env={contract.MOONCAKE_CONFIG_ENV: CONFIG_FILE},
        )

    def cluster_client(self) -> StoreClient:
        return self._client(cluster_master(self.md))

    def workloads(self) -> list[Manifest]:
        return [master_service(self.md), master_deployment(self.md)]

    def components(self) -> list[str]:
        return [MASTER]

    def policies(self) -> list[Manifest]:
        """The master's RPC and metadata ports, open to the deployment's workers only."""
        workers = [worker.role for worker in self.md.workers]
        ports = [{"protocol": "TCP", "port": "rpc"}, {"protocol": "TCP", "port": "metadata"}]
        ingress = [{"from": [role_peers(self.md, *workers)], "ports": ports}]
        return [ingress_policy(self.md, MASTER, ingress)]

    def pod_settings(self) -> dict[str, PodSettings]:
        return {PODS: self.md.mooncake_master.pods}

    def local_refusals(self, find_binary: Callable[[str], str | None]) -> list[str]:
        return [
            f"spec.hiCache.sharedStore.type {self.kind}: no {binary} binary on PATH "
            "(pip install mooncake-transfer-engine-non-cuda)"
            for binary in ("mooncake_master", "mooncake_http_metadata_server")
            if find_binary(binary) is None
        ]

    def local(self, state_dir: Path, free_port: Callable[[], int]) -> LocalStore:
        master = MasterPlacement(
            host=LOOPBACK,
            rpc_port=free_port(),
            metadata_port=free_port(),
            metrics_port=free_port(),
            bind_host=LOOPBACK,
            # the master's built-in metadata server binds every interface whatever its
            # host flag says (Mooncake 0.3.13): Mooncake's own one, on loopback, instead
            separate_metadata_server=True,
        )
        processes = [
            StoreProcess("mooncake-master", master_argv(master), master.rpc_port, PODS),
            StoreProcess(
                "mooncake-metadata", metadata_server_argv(master), master.metadata_port, PODS
            ),
        ]
        return LocalStore(self._client(master), processes)
