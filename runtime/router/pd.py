"""Prefill/decode pairing: SGLang's bootstrap fields added to the request both workers get.

The router sends one JSON body to a prefill and a decode worker, with

- ``bootstrap_host``: the prefill worker's host (where its KV bootstrap server listens),
- ``bootstrap_port``: that server's port (the pod's ``kvflow.dev/bootstrap-port``
  annotation, a ``URL#PORT`` flag entry, or ``--bootstrap-port``),
- ``bootstrap_room``: a random 63-bit integer naming this transfer on both sides,

as SGLang's router does, so either router can drive either project's workers. A
``/generate`` batch (``text`` or ``input_ids`` a list of prompts) gets one room per prompt
and the three fields as lists. With the deployment's internal key the router also signs
each pair (``bootstrap_token``, see :mod:`kvflow.runtime.wire.pair_token`): a kvflow decode
contacts only a prefill its router chose.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from kvflow.runtime.router.worker import Worker
from kvflow.runtime.wire import Bootstrap
from kvflow.runtime.wire.pair_token import sign_pair

__all__ = ["BOOTSTRAP_FIELDS", "least_loaded", "pd_body"]

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_token")
_ROOM_BITS = 63


def least_loaded(candidates: Sequence[Worker]) -> Worker:
    """The decode worker: fewest requests in flight (ties: the first by URL)."""
    return min(candidates, key=lambda w: w.load)


def _batch_size(path: str, payload: dict[str, Any]) -> int | None:
    if path != "/generate":
        return None
    text, ids = payload.get("text"), payload.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def pd_body(
    path: str,
    payload: dict[str, Any],
    prefill: Worker,
    default_bootstrap_port: int,
    key: str | None = None,
    rng: random.Random | None = None,
) -> bytes:
    """The body both workers of the pair get: ``payload`` plus the bootstrap fields (and
    the pair's ``bootstrap_token`` when ``key`` is given)."""
    draw = (rng or random).getrandbits
    host = prefill.host
    port = prefill.spec.bootstrap_port or default_bootstrap_port
    batch = _batch_size(path, payload)
    rooms = [draw(_ROOM_BITS) for _ in range(batch or 1)]
    tokens = [sign_pair(key, Bootstrap(host, port, room)) for room in rooms] if key else None
    fields: dict[str, Any]
    if batch is None:
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rooms[0]}
        if tokens:
            fields["bootstrap_token"] = tokens[0]
    else:
        fields = {
            "bootstrap_host": [host] * batch,
            "bootstrap_port": [port] * batch,
            "bootstrap_room": rooms,
        }
        if tokens:
            fields["bootstrap_token"] = tokens
    # a client's own token never passes: only this router's signature counts
    kept = {k: v for k, v in payload.items() if k != "bootstrap_token"}
    return json.dumps({**kept, **fields}).encode()
