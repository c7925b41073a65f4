"""How many pods each worker role runs: an input of rendering, decided outside it.

``spec.<role>.replicas`` is always the user's number. The size a role is rendered with is a
:class:`DesiredSizes`: the user's number for a fixed role; for an autoscaled role the
autoscaler's last decision (``autoscale.scale.decided_sizes`` reads it from the status) or,
before any, the user's number, clamped into the role's bounds either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .spec import ModelDeployment, WorkerRole

__all__ = ["DesiredSizes", "desired_sizes"]


@dataclass(frozen=True)
class DesiredSizes:
    """Role -> the replicas its Deployment is rendered with (every worker role)."""

    replicas: Mapping[str, int]

    def __getitem__(self, role: str) -> int:
        return self.replicas[role]


def _clamped(worker: WorkerRole, replicas: int) -> int:
    bounds = worker.autoscaling
    return min(max(replicas, bounds.min_replicas), bounds.max_replicas)


def desired_sizes(md: ModelDeployment, decided: Mapping[str, int] | None = None) -> DesiredSizes:
    """Each role's size, given the autoscaler's ``decided`` sizes (role -> replicas; only
    autoscaled roles read theirs)."""
    replicas = {}
    for worker in md.workers:
        if worker.autoscaling.enabled:
            size = (decided or {}).get(worker.role, worker.replicas)
            replicas[worker.role] = _clamped(worker, size)
        else:
            replicas[worker.role] = worker.replicas
    return DesiredSizes(replicas)
