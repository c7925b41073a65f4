"""``power_of_two``: two random candidates, the less loaded one wins."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvflow.runtime.router.config import RouterConfig
from kvflow.runtime.router.policies.base import Policy, Selection
from kvflow.runtime.router.worker import Worker

__all__ = ["PowerOfTwoPolicy"]


class PowerOfTwoPolicy(Policy):
    """Load is :attr:`Worker.load`: the router's in-flight count refined by what the worker
    reports in ``/metrics`` (scraped on the health-check timer)."""

    def __init__(
        self, config: RouterConfig | None = None, rng: random.Random | None = None
    ) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], key: str) -> Selection:
        if len(candidates) == 1:
            return Selection(candidates[0])
        first, second = self._rng.sample(list(candidates), 2)
        return Selection(second if second.load < first.load else first)
