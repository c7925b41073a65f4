"""Data parallelism behind one tokenizer manager: which scheduler group gets a message.

``--dp-size N`` runs N independent scheduler groups (each ``--tp-size`` ranks with its own
KV pool and prefix cache). A new request goes to one group by SGLang's
``--load-balance-method``: ``round_robin``, or ``shortest_queue`` (the group with the
fewest requests this manager has sent it that have not finished). An abort goes to the
group that holds its request; a control request goes to every group, and their
statistics add up (:func:`merge_stats`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import zmq

from kvflow.runtime.server.ipc import IpcPaths, Pusher
from kvflow.runtime.wire.hicache import HiCacheStats
from kvflow.runtime.wire.messages import AbortRequest, GenerateRequest, SchedulerStats

__all__ = ["LOAD_BALANCE_METHODS", "DataParallelDispatcher", "merge_stats"]

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")


class DataParallelDispatcher:
    """The tokenizer manager's sender to the scheduler groups (one group: a plain sender).
    Not thread-safe: the manager's event loop calls it."""

    def __init__(self, ctx: zmq.Context, paths: IpcPaths, dp_size: int, method: str) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown load balance method {method!r}: {LOAD_BALANCE_METHODS}")
        self.groups = [Pusher(ctx, paths.scheduler_inbox(g)) for g in range(dp_size)]
        self.method = method
        self.held: dict[str, int] = {}  # rid -> its group, until it finishes
        self.load = [0] * dp_size  # requests held per group
        self._turn = itertools.cycle(range(dp_size))

    @property
    def size(self) -> int:
        return len(self.groups)

    def pick(self) -> int:
        """The group the next request goes to."""
        if self.method == "round_robin":
            return next(self._turn)
        return min(range(self.size), key=lambda g: (self.load[g], g))

    def send(self, message: Any, group: int | None = None) -> None:
        """A request to ``group`` (default :meth:`pick`); an abort to its request's group
        (every group if none holds it: it may have finished meanwhile)."""
        if isinstance(message, GenerateRequest):
            group = self.pick() if group is None else group
            self.held[message.request_id] = group
            self.load[group] += 1
            self.groups[group].send(message)
        elif isinstance(message, AbortRequest) and message.rid in self.held:
            self.groups[self.held[message.rid]].send(message)
        else:
            self.send_all(message)

    def send_all(self, message: Any) -> None:
        for pusher in self.groups:
            pusher.send(message)

    def send_to(self, group: int, message: Any) -> None:
        self.groups[group].send(message)

    def finished(self, rid: str) -> None:
        group = self.held.pop(rid, None)
        if group is not None:
            self.load[group] -= 1


def _add(a: Any, b: Any) -> Any:
    """Field-wise sum of two stats records (numbers add, sequences join, the rest: a's)."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, (bool, str)):
        return a
    if isinstance(a, (int, float, tuple)):
        return a + b
    if isinstance(a, HiCacheStats):
        return dataclasses.replace(
            a, **{f.name: _add(getattr(a, f.name), getattr(b, f.name)) for f in _fields(a)}
        )
    return a


def _fields(record: Any) -> list[dataclasses.Field]:
    return list(dataclasses.fields(record))


def merge_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """The server's statistics from each group's: counts, pool sizes and totals add up
    (each group has its own KV pool and request rows)."""
    merged = parts[0]
    for part in parts[1:]:
        merged = dataclasses.replace(
            merged,
            **{f.name: _add(getattr(merged, f.name), getattr(part, f.name)) for f in _fields(part)},
        )
    return dataclasses.replace(merged, dp_rank=0)
