"""The KV-transport contract: one-sided writes of local memory into a peer's memory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from kvflow.runtime.disagg.plan import SlotPlan, Write

__all__ = ["KVTransport", "TransferError"]


class TransferError(RuntimeError):
    """A write did not complete: the peer is dead, unreachable, too slow, or refused it."""


class KVTransport(ABC):
    """One endpoint of a KV transfer engine.

    - :attr:`session_id` is ``"host:port"``: what peers pass to :meth:`write` to reach
      this endpoint. The host is the advertised address (``$KVFLOW_POD_IP`` where set).
    - :meth:`register` makes local memory (the KV pool's buffers, see
      ``KVLayout.regions``) reachable by peers. Memory must be registered on both sides:
      the source of a write and its destination. It must stay allocated until
      :meth:`close`.
    - :meth:`write` copies every ``Write`` (local ``src_ptr`` -> the peer's ``dst_ptr``)
      and returns once all bytes are at the peer; :meth:`write_plan` does the same for a
      plan of slot runs (the prefill's call), as byte ranges unless the transport copies
      runs itself. It raises :class:`TransferError` with a
      message on any failure, within a bounded time (implementations state the bound);
      it never hangs. On error, any subset of the writes may have landed.
    - Nothing is written into this endpoint's memory without a peer calling
      :meth:`write`; there is no notification of arrival (completion is signalled out of
      band, by the caller).
    - :meth:`write` may be called from several threads at once. :meth:`close` is called
      once, after the last :meth:`write` returned.
    - :meth:`peer_info` is what this endpoint tells the peers that write into it (it
      travels in the decode's bootstrap registration); the writer passes it to
      :meth:`add_peer` before its first :meth:`write` to that session, which raises
      :class:`TransferError` when the writer cannot reach such a peer (another transport,
      another host for a same-host one).
    - :attr:`retries` counts the engine calls repeated since start (after a rejection or a
      transient failure); a write that needed them still succeeded or failed as a whole.

    NOTE: a write abandoned at its deadline may still be running inside the engine and
    may still land bytes afterwards (see the implementation's bound). A receiver that
    gives up on a transfer must not hand its slots to another request before that bound
    has passed.
    """

    name: str = "mooncake"  # the registry's name, as peers are told

    @classmethod
    @abstractmethod
    def require_env(cls, options: Any) -> None:
        """State process-wide settings (the environment) the transport needs, before any
        engine of this process starts; ``options`` is a ``KVTransferOptions``."""

    @property
    @abstractmethod
    def session_id(self) -> str: ...

    @property
    def retries(self) -> int:
        return 0

    def peer_info(self) -> dict[str, Any]:
        return {"transport": self.name}

    def add_peer(self, session_id: str, info: dict[str, Any]) -> None:
        """Check (and prepare) a peer that registered with ``info``; the default checks
        that it runs this transport."""
        theirs = info.get("transport")
        if theirs != self.name:
            raise TransferError(
                f"the decode's KV transport is {theirs!r}, this prefill's {self.name!r} "
                "(--disaggregation-transfer-backend must match)"
            )

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None: ...

    def register_buffer(self, buffer: Any) -> None:
        """Register a contiguous tensor's bytes (what the roles call for each K and V
        buffer of the pool); a transport that shares memory by tensor overrides it."""
        self.register(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    @abstractmethod
    def write(self, session_id: str, writes: Sequence[Write], after: Any = None) -> None:
        """``after``: a CUDA event recorded where the source bytes were made (the forward
        pass that wrote the KV); the write reads them only once it completed. None: the
        bytes are ready now."""

    def write_plan(self, session_id: str, plan: SlotPlan, after: Any = None) -> None:
        """:meth:`write` of ``plan``'s byte ranges; a transport that moves slot runs
        without expanding them (one kernel for all layers) overrides it."""
        self.write(session_id, plan.writes(), after)

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
