"""What the scheduler process runs around its scheduler, by role: ``unified`` passes
requests straight through; ``prefill`` and ``decode`` own the queues of disaggregation
(:mod:`kvflow.runtime.disagg.prefill`, :mod:`kvflow.runtime.disagg.decode`) and reach the
scheduler only through its :class:`~kvflow.runtime.scheduler.SchedulerPort`.

Everything a role changes about the engine is declared on its class, in one place:
:meth:`Role.engine_config` (the decode keeps no prefix cache), :attr:`Role.parks_finished`
(the prefill keeps finished requests' KV until it is sent) and :meth:`Role.prepare` (the
prefill samples only the first token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

from kvflow.runtime.config import EngineConfig
from kvflow.runtime.disagg.layout import FeatureBuffer, layout_of
from kvflow.runtime.disagg.transfer_log import TransferTotals
from kvflow.runtime.disagg.transport import KVTransferOptions
from kvflow.runtime.scheduler import Req, SchedulerPort
from kvflow.runtime.utils import Registry
from kvflow.runtime.wire import GenerateRequest, TokenOutput
from kvflow.runtime.wire.disagg import pairing_problem

__all__ = ["ROLES", "KVRole", "Role", "RoleStats", "UnifiedRole", "make_role"]


class RoleStats(NamedTuple):
    """A role's queues (SGLang's names without the ``num_..._reqs``) and its KV writes."""

    prefill_inflight: int = 0  # prefilled, waiting for a claim or being sent
    decode_prealloc: int = 0  # waiting for KV slots
    decode_transfer: int = 0  # slots claimed, waiting for the prefill's KV
    transfers: TransferTotals = TransferTotals()


class Role:
    """The scheduler process's hooks. The loop calls, in order each iteration:
    :meth:`prepare` then :meth:`add` for new requests (``ValueError`` refuses one, and
    :meth:`refused` hears of it),
    :meth:`poll` (outputs of requests the role finished outside the scheduler), the
    scheduler's step; :meth:`observe` sees the outputs of the step and of handled messages
    (aborts) and returns what is sent on. :meth:`abort` ends a request the role holds
    outside the scheduler (None if it holds no such request). :meth:`busy` keeps the loop
    from idling; ``wake`` (thread-safe) ends the loop's wait for messages at once, so
    :meth:`poll` runs: a role calls it when what it waits on outside the loop happened (a
    room's outcome, a claim, a write's end) instead of letting the loop find out one
    poll interval later."""

    name: ClassVar[str] = "unified"
    parks_finished: ClassVar[bool] = False  # the scheduler keeps finished requests' KV

    def __init__(self, port: SchedulerPort, wake: Callable[[], None] | None = None) -> None:
        self.port = port
        self.wake: Callable[[], None] = wake or _stay

    @classmethod
    def engine_config(cls, config: EngineConfig) -> EngineConfig:
        """The engine this role runs (unchanged: unified)."""
        return config

    def prepare(self, message: GenerateRequest) -> GenerateRequest:
        """The message as this role runs it (unchanged: unified)."""
        return message

    def add(self, req: Req) -> None:
        """Take a new request (``ValueError`` refuses it): one with bootstrap fields on a
        PD role, one without on the unified role, then :meth:`admit`."""
        problem = pairing_problem(self.name, req.bootstrap)
        if problem:
            raise ValueError(problem)
        self.admit(req)

    def admit(self, req: Req) -> None:
        """Queue a request that passed :meth:`add`'s check (unified: straight to prefill)."""
        self.port.admit(req)

    def poll(self) -> list[TokenOutput]:
        return []

    def observe(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """See the step's outputs; returns what the server answers its clients."""
        return outputs

    def abort(self, rid: str, message: str) -> TokenOutput | None:
        return None

    def refused(self, message: GenerateRequest, why: str) -> None:
        """A new request was refused (anywhere from building it to :meth:`admit`): the
        role tells its peer, if it has one waiting (nothing here)."""

    def busy(self) -> bool:
        return False

    def info(self) -> dict[str, Any]:
        """Facts for ``/get_server_info`` (the prefill's bootstrap port, ...)."""
        return {}

    def stats(self) -> RoleStats:
        return RoleStats()


class KVRole(Role):
    """A role that moves KV (prefill and decode): this rank's transport, from
    ``transfer``, with every K and V buffer of its pool registered (and an EAGLE target's
    features), and the pool's :class:`~kvflow.runtime.disagg.layout.KVLayout` as the peer
    sees it."""

    def __init__(
        self,
        port: SchedulerPort,
        transfer: KVTransferOptions,
        wake: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(port, wake)
        self.lockstep = port.lockstep
        self.transport = transfer.transport()
        features = None
        if port.feature_pool is not None:
            features = FeatureBuffer(port.feature_kind, port.feature_pool)
        self.layout = layout_of(
            port.kv_pool, port.model_config, port.page_size, port.kv_heads, features
        )
        extra = () if features is None else (features.buffer,)
        for buffer in (*port.kv_pool.k_buffer, *port.kv_pool.v_buffer, *extra):
            self.transport.register_buffer(buffer)


def _stay() -> None:
    """No loop to wake (a role built outside the scheduler process)."""


UnifiedRole = Role

# role -> its class (imported on use: the transports load native libraries)
ROLES: Registry[Role] = Registry("role")
ROLES.register("unified", "kvflow.runtime.disagg.roles:UnifiedRole")
ROLES.register("prefill", "kvflow.runtime.disagg.prefill:PrefillRole")
ROLES.register("decode", "kvflow.runtime.disagg.decode:DecodeRole")


def make_role(
    name: str,
    port: SchedulerPort,
    transfer: KVTransferOptions | None,
    wake: Callable[[], None] | None = None,
) -> Role:
    """The role ``name`` around ``port``; prefill and decode need ``transfer``. ``wake``
    ends the scheduler loop's wait for messages (see :class:`Role`)."""
    role_cls: Any = ROLES.get(name)
    if role_cls is UnifiedRole:
        return role_cls(port, wake)
    if transfer is None:
        raise ValueError(f"the {name} role needs KV transfer options")
    return role_cls(port, transfer, wake)
