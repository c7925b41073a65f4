"""The runtime ConfigMap: ``runtime.json`` (the resolved per-role settings) and the shared
store's client files.

Worker pods mount it at :data:`contract.RUNTIME_CONFIG_DIR`. Only the store's files
(``mooncake.json``, named by ``$KVFLOW_MOONCAKE_CONFIG``) are read by a process;
``runtime.json`` is for people (``kubectl get cm NAME-runtime -o yaml``): each worker's
settings are all in its command, which the document repeats. A hash of the worker part goes
into their pod template (``kvflow.dev/config-hash``) so that a configuration change rolls
them. The router section stays out of that hash: a router-only edit rolls only the
router's pods.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvflow import contract

from . import names
from .lora import cluster_adapter_storage
from .pods import model_mount, worker_serve_options
from .spec import ModelDeployment
from .stores import shared_store

RUNTIME_CONFIG_FILE = "runtime.json"


def worker_config(md: ModelDeployment) -> dict[str, Any]:
    """What the worker roles run, resolved: ``runtime.json`` less the router section.

    Replica counts stay out: scaling must not change the hash and roll every pod.
    """
    model_path = model_mount(md).model_path
    return {
        "deployment": md.name,
        "mode": md.mode,
        "model": {"source": md.model.source, "servedModelName": md.model.served_model_name},
        "roles": {
            worker.role: {"argv": contract.serve_argv(worker_serve_options(md, worker, model_path))}
            for worker in md.workers
        },
        "kvTransfer": {
            "backend": md.kv_transfer.backend,
            "protocol": md.kv_transfer.protocol,
            "bootstrapPort": md.kv_transfer.bootstrap_port,
            "portRange": list(contract.KV_TRANSFER_PORT_RANGE),
        },
        "hiCache": {
            "hostMemoryBytes": md.hicache.host_memory_bytes,
            "writePolicy": md.hicache.write_policy,
            "store": md.hicache.store,
        },
    }


def runtime_config(md: ModelDeployment) -> dict[str, Any]:
    """What each role runs, router included: ``runtime.json``, read by people only."""
    router: dict[str, Any] = {"policy": md.router.policy}
    if md.lora is not None:  # kept loaded by the router (pod annotations), not the pods' own
        router["loraAdapters"] = dict(cluster_adapter_storage(md).paths)
    return {**worker_config(md), "router": router}


def _documents(md: ModelDeployment, runtime: dict[str, Any]) -> dict[str, str]:
    # Sorted keys: the same spec gives the same bytes, hence the same hash.
    data = {RUNTIME_CONFIG_FILE: json.dumps(runtime, indent=2, sort_keys=True)}
    store = shared_store(md)
    if store is not None:
        data.update(store.cluster_client().files)
    return data


def config_data(md: ModelDeployment) -> dict[str, str]:
    """The ConfigMap's ``data``: JSON documents with sorted keys."""
    return _documents(md, runtime_config(md))


def worker_config_hash(md: ModelDeployment) -> str:
    """Short content hash of what worker pods read from the ConfigMap (router fields out)."""
    data = _documents(md, worker_config(md))
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    return digest[:16]


def runtime_config_map(md: ModelDeployment) -> dict[str, Any]:
    """ConfigMap ``<name>-runtime``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.object_meta(md, names.child_name(md.name, "runtime"), "runtime"),
        "data": config_data(md),
    }
