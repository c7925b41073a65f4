"""Prefill/decode under tensor parallelism: every rank's KV endpoint, and the rule that pairs
ranks.

Each rank of a tensor-parallel group holds its KV-head shard in its own pool, behind its own
transport endpoint. Prefill rank ``r`` writes its shard into decode rank ``r``'s pool, at
the slots the decode claimed (its ranks allocate in lockstep, so the slot indices are the
same on every rank). Only rank 0 of each side speaks the bootstrap routes: the decode's
rank 0 registers every rank's endpoint at once, the prefill's rank 0 checks each against
its own rank's layout, and both decide for their ranks (see ``prefill.py``, ``decode.py``).

Wire format of ``POST /register`` (one rank: exactly the fields it always had)::

    {"session", "layout", "peer"}                              rank 0 (the only one)
    + "tp_size": N, "ranks": [{"session", "layout", "peer"}]   ranks 1 .. N-1, when N > 1

The answer carries the prefill's ``"layout"`` (its rank 0's) and ``"tp_size"`` when above 1.
A missing ``tp_size`` means 1, so a peer that predates tensor parallelism is seen as one
rank: a pair whose sizes differ is refused on whichever side knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvflow.runtime.disagg.layout import KVLayout

__all__ = ["Endpoint", "parse_registration", "registration", "tp_size_of", "tp_size_problem"]

_DEFAULT_PEER = {"transport": "mooncake"}  # what a decode that sends no peer info runs
_MAX_TP = 1024


class Endpoint(NamedTuple):
    """One rank's KV pool as a writer reaches it: its transport session, its layout and its
    transport's peer info (None: not sent, a Mooncake TCP decode)."""

    session: str
    layout: KVLayout
    peer: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        body = {"session": self.session, "layout": self.layout.to_dict()}
        return body if self.peer is None else {**body, "peer": self.peer}

    @classmethod
    def from_dict(cls, raw: Any) -> Endpoint:
        """A registered rank; ValueError (a 400) when it is not one."""
        if not isinstance(raw, dict):
            raise ValueError("a rank's endpoint must be an object")
        peer = raw.get("peer", _DEFAULT_PEER)
        if not isinstance(peer, dict):
            raise ValueError("peer must be an object")
        return cls(str(raw["session"]), KVLayout.from_dict(raw["layout"]), peer)


def tp_size_of(body: dict[str, Any]) -> int:
    """The ``tp_size`` a registration or its answer states (1 when absent)."""
    size = body.get("tp_size", 1)
    if type(size) is not int or not 1 <= size <= _MAX_TP:  # bool is not a size
        raise ValueError(f"tp_size must be an integer in [1, {_MAX_TP}]")
    return size


def registration(ranks: Sequence[Endpoint]) -> dict[str, Any]:
    """The body of ``POST /register`` for a decode's ranks (rank 0 first)."""
    body = ranks[0].to_dict()
    if len(ranks) > 1:
        body.update(tp_size=len(ranks), ranks=[rank.to_dict() for rank in ranks[1:]])
    return body


def parse_registration(body: dict[str, Any]) -> tuple[Endpoint, ...]:
    """Every rank a registration names, rank 0 first; ValueError when it is malformed."""
    size = tp_size_of(body)
    others = body.get("ranks", [])
    if not isinstance(others, list) or len(others) != size - 1:
        raise ValueError(f"a registration of tp_size {size} needs {size - 1} more ranks")
    return tuple(Endpoint.from_dict(raw) for raw in [body, *others])


def tp_size_problem(prefill: int, decode: int) -> str | None:
    """Why a prefill of ``prefill`` ranks and a decode of ``decode`` cannot pair; None if
    they can (the same size)."""
    if prefill == decode:
        return None
    return (
        f"tensor-parallel size differs (prefill --tp-size {prefill}, decode --tp-size "
        f"{decode}): each prefill rank writes its KV-head shard into the decode rank of the "
        "same number, so start both with the same --tp-size"
    )
