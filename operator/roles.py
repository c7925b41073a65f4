"""What each role runs, wherever it runs: the runtime options of workers and router.

These are the engine's and the router's behaviour (role, KV transfer, HiCache tiers,
batch size, routing policy, extra flags), decided from the spec alone. Where a process
listens, where the weights are and how peers are addressed is placement
(:mod:`.placement`): the operator places roles in pods, ``kvflow up`` on this machine,
and both join the same options with their placement into one command.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow import contract

from .lora import lora_options
from .spec import ModelDeployment, WorkerRole
from .stores import shared_store


@dataclass(frozen=True)
class WorkerRuntime:
    """``kvflow serve`` behaviour of one worker role (no ports, paths or addresses)."""

    role: str
    served_model_name: str = ""
    kv_transfer_protocol: str | None = None
    kv_transfer_backend: str | None = None  # prefill and decode: spec.kvTransfer.backend
    tp_size: int = 1  # every GPU of the pod in use: tp_size x dp_size = the role's gpus
    dp_size: int = 1
    hicache: contract.HiCacheOptions | None = None  # storage_path: the placement's
    lora: contract.LoraOptions | None = None  # the adapters themselves: the router's
    max_running_requests: int | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouterRuntime:
    """``kvflow router`` behaviour (no ports or worker addresses)."""

    policy: str = "cache_aware"
    extra_args: tuple[str, ...] = ()


def uses_hicache(md: ModelDeployment, worker: WorkerRole) -> bool:
    """Whether a worker role runs the HiCache tiers: prefill and unified workers do; the
    decode role keeps no prefix cache (every prompt's KV comes from the prefill)."""
    return md.hicache.enabled and worker.role != "decode"


def worker_runtime(md: ModelDeployment, worker: WorkerRole) -> WorkerRuntime:
    """The runtime options of one worker role, decided from the spec."""
    hicache = None
    store = None
    if uses_hicache(md, worker):
        store = shared_store(md)
        hicache = contract.HiCacheOptions(
            host_memory_gb=md.hicache.host_memory_bytes / 2**30,
            write_policy=md.hicache.write_policy,
            storage=store.kind if store is not None else contract.NO_STORAGE,
        )
    # a store that pools the workers' memory moves pages with the KV transfer engine
    needs_transfer = md.disaggregated or (store is not None and store.pools_worker_memory)
    return WorkerRuntime(
        role=worker.role,
        served_model_name=md.model.served_model_name,
        kv_transfer_protocol=md.kv_transfer.protocol if needs_transfer else None,
        kv_transfer_backend=md.kv_transfer.backend if md.disaggregated else None,
        tp_size=worker.tp_size,
        dp_size=worker.dp_size,
        hicache=hicache,
        lora=lora_options(md),
        max_running_requests=worker.max_running_requests,
        extra_args=tuple(worker.pods.extra_args),
    )


def router_runtime(md: ModelDeployment) -> RouterRuntime:
    """The router's options, decided from the spec."""
    return RouterRuntime(policy=md.router.policy, extra_args=tuple(md.router.pods.extra_args))
