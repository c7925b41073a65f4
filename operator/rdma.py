"""RDMA for KV transfer: whether a deployment asks for it, and whether the cluster has it.

``kvTransfer.protocol: rdma`` has never run (there is no RDMA hardware where kvflow is
tested). Its pods get ``IPC_LOCK``, but the operator requests no RDMA device: device
plugins name theirs differently, so the user adds theirs to the role's
``resources.limits``. What the operator checks is that some node advertises one: an
allocatable extended resource in the ``rdma/`` domain (the k8s-rdma-shared-dev-plugin's
``rdma/hca_shared_devices_a``) or whose name mentions rdma (``<vendor>/rdma_...``). Without
one, the pods could not move KV over RDMA anywhere, so the deployment is refused with
:data:`RDMA_UNAVAILABLE` (a ``Degraded`` reason) instead of rendered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .quantity import QuantityError, parse_quantity
from .roles import worker_runtime
from .spec import ModelDeployment

RDMA_UNAVAILABLE = "RDMAUnavailable"


def uses_rdma(md: ModelDeployment) -> bool:
    """Whether a worker's transfer engine would run with the rdma protocol (PD transfer,
    or a store that pools the workers' memory)."""
    return any(worker_runtime(md, w).kv_transfer_protocol == "rdma" for w in md.workers)


def is_rdma_resource(name: str) -> bool:
    domain, _, resource = name.rpartition("/")
    return domain == "rdma" or (bool(domain) and "rdma" in resource.lower())


def rdma_resources(nodes: Iterable[Mapping[str, Any]]) -> list[str]:
    """``node/resource`` for every RDMA resource a node has allocatable (more than zero)."""
    found = []
    for node in nodes:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        for resource, amount in allocatable.items():
            try:
                available = parse_quantity(str(amount)) > 0
            except QuantityError:
                available = False
            if available and is_rdma_resource(str(resource)):
                found.append(f"{node['metadata']['name']}/{resource}")
    return sorted(found)


def rdma_refusal(md: ModelDeployment, nodes: Iterable[Mapping[str, Any]]) -> str | None:
    """Why ``md`` cannot run here (None: it does not use RDMA, or a node offers it)."""
    if not uses_rdma(md) or rdma_resources(nodes):
        return None
    return (
        "spec.kvTransfer.protocol is rdma but no node advertises an allocatable RDMA resource "
        "(rdma/* or <domain>/*rdma*, from an RDMA device plugin); use tcp, or install the "
        "device plugin and request its resource in the roles' resources.limits"
    )
