"""The contract of a routing policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from kvflow.runtime.router.worker import Worker

__all__ = ["Policy", "Selection"]


class Selection(NamedTuple):
    worker: Worker
    match_ratio: float | None = None  # cache_aware only: matched / prompt length


class Policy(ABC):
    """Chooses one worker among candidates for one request.

    ``candidates`` is never empty: only available workers (healthy, breaker not open) of the
    wanted role, sorted by URL, minus those this request already failed on. ``key`` is the
    request's routing key (``prompt.routing_key``); it is computed, which parses the body,
    only when ``needs_key`` is true. ``select`` runs on the event loop and must not block;
    it may update the policy's own state (a round-robin cursor, what a tree learnt).
    """

    needs_key: bool = False

    @abstractmethod
    def select(self, candidates: Sequence[Worker], key: str) -> Selection: ...

    def forget(self, url: str) -> None:  # noqa: B027 (an optional hook: most keep nothing)
        """The worker left the set: drop what the policy keeps about it."""
