"""What each role runs, wherever it runs: the runtime options of workers and router.

These are the engine's and the router's behaviour (role, KV transfer, HiCache tiers,
batch size, routing policy, extra flags), decided from the spec alone. Where a process
listens, where the weights are and how peers are addressed is placement
(:mod:`.placement`): the operator places roles in pods, ``kvflow up`` on this machine,
and both join the same options with their placement into one command.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ModelDeployment, WorkerRole


@dataclass(frozen=True)
class WorkerRuntime:
    """``kvflow serve`` behaviour of one worker role (no ports, paths or addresses)."""

    role: str
    served_model_name: str = ""
    kv_transfer_protocol: str | None = None
    hicache_host_memory_gb: float | None = None
    hicache_write_policy: str | None = None
    hicache_storage: str | None = None  # none/None | file | mooncake
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
    hicache = md.hicache
    tiered = uses_hicache(md, worker)
    needs_transfer = md.disaggregated or (tiered and hicache.store == "mooncake")
    return WorkerRuntime(
        role=worker.role,
        served_model_name=md.model.served_model_name,
        kv_transfer_protocol=md.kv_transfer.protocol if needs_transfer else None,
        hicache_host_memory_gb=hicache.host_memory_bytes / 2**30 if tiered else None,
        hicache_write_policy=hicache.write_policy if tiered else None,
        hicache_storage=hicache.store if tiered and hicache.store != "none" else None,
        max_running_requests=worker.max_running_requests,
        extra_args=tuple(worker.pods.extra_args),
    )


def router_runtime(md: ModelDeployment) -> RouterRuntime:
    """The router's options, decided from the spec."""
    return RouterRuntime(policy=md.router.policy, extra_args=tuple(md.router.pods.extra_args))
