"""What the scheduler process runs around its scheduler, by role: ``unified`` passes
requests straight through; ``prefill`` and ``decode`` add the queues of disaggregation
(:mod:`kvflow.runtime.disagg.prefill`, :mod:`kvflow.runtime.disagg.decode`)."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

from kvflow.runtime.disagg.transfer_log import TransferTotals
from kvflow.runtime.scheduler import Req, Scheduler
from kvflow.runtime.wire import TokenOutput

__all__ = ["ROLE_CLASSES", "Role", "RoleStats", "UnifiedRole", "make_role"]


class RoleStats(NamedTuple):
    """A role's queues (SGLang's names without the ``num_..._reqs``) and its KV writes."""

    prefill_inflight: int = 0  # prefilled, waiting for a claim or being sent
    decode_prealloc: int = 0  # waiting for KV slots
    decode_transfer: int = 0  # slots claimed, waiting for the prefill's KV
    transfers: TransferTotals = TransferTotals()


class Role:
    """The scheduler process's hooks. The loop calls, in order each iteration: :meth:`add`
    for new requests (``ValueError`` refuses one), :meth:`poll` (outputs of requests the
    role finished outside the scheduler), the scheduler's step; :meth:`observe` sees the
    outputs of the step and of handled messages (aborts) and returns what is sent on.
    :meth:`abort` ends a request the role holds outside the scheduler
    (None if it holds no such request). :meth:`busy` keeps the loop from idling."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def add(self, req: Req) -> None:
        if req.bootstrap is not None:
            raise ValueError(
                "this server runs the unified role: bootstrap_room is for prefill/decode servers"
            )
        self.scheduler.add_request(req)

    def poll(self) -> list[TokenOutput]:
        return []

    def observe(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """See the step's outputs; returns what the server answers its clients."""
        return outputs

    def abort(self, rid: str, message: str) -> TokenOutput | None:
        return None

    def busy(self) -> bool:
        return False

    def info(self) -> dict[str, Any]:
        """Facts for ``/get_server_info`` (the prefill's bootstrap port, ...)."""
        return {}

    def stats(self) -> RoleStats:
        return RoleStats()


UnifiedRole = Role

# role -> "module:Class" (imported on use: the transports load native libraries)
ROLE_CLASSES = {
    "unified": "kvflow.runtime.disagg.roles:UnifiedRole",
    "prefill": "kvflow.runtime.disagg.prefill:PrefillRole",
    "decode": "kvflow.runtime.disagg.decode:DecodeRole",
}


def make_role(name: str, scheduler: Scheduler, **options: Any) -> Role:
    module, cls = ROLE_CLASSES[name].split(":")
    role_cls = getattr(importlib.import_module(module), cls)
    return role_cls(scheduler) if name == "unified" else role_cls(scheduler, **options)
