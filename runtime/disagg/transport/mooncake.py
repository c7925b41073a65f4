"""KV transport over the Mooncake transfer engine, peer-to-peer handshake (no metadata server).

Measured with ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1 over TCP:

- Ports: in P2P-handshake mode the engine ignores any port in its local hostname and draws
  both of its listening ports (handshake RPC and TCP data) at random from
  ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]`` (default 15000-17000), read once per process when
  ``mooncake.engine`` is imported. We default that range to ``KV_TRANSFER_PORT_RANGE``
  before importing it (an earlier import elsewhere defeats this: a warning says so); the
  exact port cannot be chosen. Both sockets listen on every interface; only the advertised host
  is ours to pick.
- A dead peer (connection refused or reset) fails at once. A peer that accepts but stops
  answering (frozen process, a black-holed network) blocks a data transfer for
  ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (default 30 s; we default it to the write timeout) and a
  first handshake for 60 s (a fixed receive timeout in the engine). Hence every engine
  call runs on its own thread under a deadline; see :class:`MooncakeTransport`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.contract import KV_TRANSFER_PORT_RANGE, POD_IP_ENV
from kvflow.runtime.disagg.plan import Write
from kvflow.runtime.disagg.transport.base import KVTransport, TransferError
from kvflow.runtime.utils import mooncake_env

__all__ = ["MooncakeTransport"]

logger = logging.getLogger(__name__)

# The slowest transfer rate still counted as progress: a write's deadline is
# timeout_s + its bytes at this rate.
MIN_BYTES_PER_S = 100e6
# Writes per engine call. NOTE: the TCP transport queues at most
# MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER transfers per peer (measured: a batch of 2048 passed,
# 2100 failed as a whole, and calls right after such a failure sometimes failed too), so
# batches stay well below.
MAX_BATCH = 1024
# Engine calls abandoned at their deadline keep their engine alive here: destroying an
# engine while a call still runs inside it would crash the process.
_ABANDONED_ENGINES: list[object] = []


class _PeerLock:
    """A lock a ``WeakValueDictionary`` can hold (``threading.Lock`` takes no weak
    reference)."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> _PeerLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class MooncakeTransport(KVTransport):
    """The Mooncake ``TransferEngine`` as a :class:`KVTransport`.

    ``host`` is the address advertised in :attr:`session_id`: ``$KVFLOW_POD_IP`` when set,
    else 127.0.0.1. ``protocol`` and ``device_name`` go to the engine unchanged (``tcp``
    is what runs here; ``rdma`` needs the CUDA wheel and RDMA devices).

    Bound of :meth:`write`: ``timeout_s + nbytes / MIN_BYTES_PER_S`` seconds. A call still
    inside the engine at that deadline is abandoned, not stopped: it ends within the
    engine's own timeouts (data: ``MC_TCP_PROGRESS_TIMEOUT_SEC``; first handshake with a
    peer: 60 s, fixed in the engine) and may land bytes until then.
    """

    def __init__(
        self,
        protocol: str = "tcp",
        device_name: str = "",
        host: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        mooncake_env.require("the PD KV transport", timeout_s)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                f"Mooncake transfer engine unavailable ({exc}); install "
                "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA), "
                "and Debian's libibverbs1 and librdmacm1"
            ) from exc
        self.host = host or os.environ.get(POD_IP_ENV) or "127.0.0.1"
        self.timeout_s = timeout_s
        self._engine: Any = TransferEngine()
        status = self._engine.initialize(self.host, "P2PHANDSHAKE", protocol, device_name)
        if status != 0:
            raise TransferError(
                f"Mooncake engine did not start on {self.host} over {protocol} "
                f"(status {status}; its log on stderr says why)"
            )
        port = self._engine.get_rpc_port()
        self._session_id = f"{self.host}:{port}"
        low, high = KV_TRANSFER_PORT_RANGE
        if not low <= port <= high:
            logger.warning(
                "Mooncake listens on port %d, outside KV_TRANSFER_PORT_RANGE %d-%d: "
                "mooncake.engine was imported before MooncakeTransport set MC_MIN_RPC_PORT, "
                "or MC_MIN_RPC_PORT/MC_MAX_RPC_PORT are set otherwise",
                port,
                low,
                high,
            )
        self._registered: list[int] = []
        self._lock = threading.Lock()
        # session -> one write at a time; an entry lives while a writer holds its lock, so
        # the table does not grow with every decode process a prefill has ever served
        self._peer_locks: weakref.WeakValueDictionary[str, _PeerLock] = (
            weakref.WeakValueDictionary()
        )
        self._abandoned = 0  # calls past their deadline still running inside the engine

    @classmethod
    def require_env(cls, options: Any) -> None:
        mooncake_env.require("the PD KV transport", options.timeout_s)

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        status = self._engine.register_memory(ptr, nbytes)
        if status != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at {ptr:#x}")
        self._registered.append(ptr)

    def write(self, session_id: str, writes: Sequence[Write]) -> None:
        if not writes:
            return
        host, _, port = session_id.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"KV transfer session {session_id!r} is not 'host:port'")
        total = sum(w.nbytes for w in writes)
        with self._lock:
            peer_lock = self._peer_locks.setdefault(session_id, _PeerLock())
        # One write per peer at a time: the engine's per-peer TCP queue holds a few thousand
        # pieces across all calls, and concurrent writes to one peer overflow it ("TCP lane
        # queue-full rejection"; 8 threads of 1,024 pieces failed here, one at a time did
        # not, and went faster). Each holder is bounded by its own deadline.
        with peer_lock:
            status = self._call(
                lambda: self._write_batches(session_id, writes),
                deadline_s=self.timeout_s + total / MIN_BYTES_PER_S,
                what=f"write of {total} bytes in {len(writes)} pieces to {session_id}",
            )
        if status != 0:
            raise TransferError(
                f"KV {total}-byte write in {len(writes)} pieces to {session_id} failed "
                f"(engine status {status}: peer dead, unreachable, or the addresses are not "
                "registered there; the engine's log on stderr says which)"
            )

    def _write_batches(self, session_id: str, writes: Sequence[Write]) -> int:
        for start in range(0, len(writes), MAX_BATCH):
            batch = writes[start : start + MAX_BATCH]
            status = self._engine.batch_transfer_sync_write(
                session_id,
                [w.src_ptr for w in batch],
                [w.dst_ptr for w in batch],
                [w.nbytes for w in batch],
            )
            if status != 0:
                return int(status)
        return 0

    def _call(self, call: Callable[[], int], deadline_s: float, what: str) -> int:
        """Run one blocking engine call on its own thread, raise at the deadline."""
        outcome: list[int | BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append(call())
            except BaseException as exc:  # handed to the caller's thread
                outcome.append(exc)
            finally:
                with self._lock:
                    done.set()
                    if abandoned:
                        self._abandoned -= 1

        abandoned = False
        threading.Thread(target=run, name="kv-transfer", daemon=True).start()
        if not done.wait(deadline_s):
            with self._lock:
                if not done.is_set():
                    abandoned = True
                    self._abandoned += 1
            if abandoned:
                raise TransferError(f"KV {what} did not finish within {deadline_s:.1f} s")
        result = outcome[0]
        if isinstance(result, BaseException):
            raise TransferError(f"KV {what} raised {result!r}") from result
        return result

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        with self._lock:
            still_running = self._abandoned
        if still_running:
            # NOTE: destroying the engine under a running call would crash the process.
            logger.warning("%d abandoned KV transfer(s) still running; engine kept", still_running)
            _ABANDONED_ENGINES.append(engine)
            return
        for ptr in self._registered:
            engine.unregister_memory(ptr)
        self._registered.clear()
