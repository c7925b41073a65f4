"""``round_robin``: each request to the next available worker."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.runtime.router.config import RouterConfig
from kvflow.runtime.router.policies.base import Policy, Selection
from kvflow.runtime.router.worker import Worker

__all__ = ["RoundRobinPolicy"]


class RoundRobinPolicy(Policy):
    def __init__(self, config: RouterConfig | None = None) -> None:
        self._cursor = 0

    def select(self, candidates: Sequence[Worker], key: str) -> Selection:
        worker = candidates[self._cursor % len(candidates)]
        self._cursor += 1
        return Selection(worker)
