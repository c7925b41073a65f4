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
- Admission: the TCP transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
  pieces per peer (default 1,024), lets up to ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``
  more (default 1,024) wait ``MC_TCP_ADMISSION_TIMEOUT_MS`` (default 1,000) for room, and
  fails the whole call beyond that ("TCP lane queue-full rejection"; engine status -1, the
  same status as a dead peer). One call of at most the queue's size, one call per peer at a
  time, is never rejected: measured with the queue at 64, pending at 1 and a 1 ms admission
  timeout, a batch of 60 pieces landed, 240 failed at once. After a rejection the next
  call to that peer may fail too: with the queue at 16, calls with up to ~100 pieces
  rejected recovered within 50 ms; one with 300 rejected (or a first call to a new peer
  that was rejected) left every later call to that peer failing for as long as it was
  watched (15 s), while a new engine in the same process reached the peer at once. Hence
  calls never exceed the queue, and a writer whose calls to a live peer keep failing
  starts a new engine (see :class:`MooncakeTransport`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
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
# Writes per engine call at most, and the engine's own per-peer queue when the environment
# does not set it (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER; measured with the default: a batch
# of 2,048 passed (1,024 queued + 1,024 waiting for admission), 2,100 failed as a whole).
MAX_BATCH = 1024
QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
NVLINK_BATCH = 4096
# A failed engine call is repeated after RETRY_FIRST_S, doubling up to RETRY_MAX_S, while the
# write's deadline allows and the peer still accepts connections.
RETRY_FIRST_S = 0.005
RETRY_MAX_S = 0.2
# Calls of one piece that failed to a live peer before the transport starts a new engine
# (Mooncake's lanes to a peer can stay broken after a large rejection, see above), and the
# most new engines one transport starts: each replaced engine stays alive (calls may run
# in it) with its two ports and threads, and a peer that fails every call for another
# reason (its memory not registered) must not make the prefill start one per write.
RENEW_AFTER = 3
MAX_RENEWALS = 3
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

    Admission and retries: a write goes to the engine in calls of at most ``window``
    pieces, one call per peer at a time. The window starts at the engine's per-peer queue
    (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, capped at :data:`MAX_BATCH`; ``max_batch``
    overrides it). A failed call is repeated with the window halved (for the rest of that
    write), after a backoff that doubles, until the write's deadline. A peer that refuses connections is dead: its write fails at once, unrepeated.
    Repeating is safe: a call writes the same bytes to the same place. After
    :data:`RENEW_AFTER` failed one-piece calls to a live peer, the writer starts a new
    engine with the same memory registered (:meth:`_renew`); :attr:`session_id` changes
    then, which only a reader of this endpoint would notice (KV flows prefill -> decode:
    only the prefill writes, and nobody writes into it).
    """

    name = "mooncake"

    def __init__(
        self,
        protocol: str = "tcp",
        device_name: str = "",
        host: str | None = None,
        timeout_s: float = 5.0,
        max_batch: int | None = None,
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
        self.protocol = protocol
        self._start = lambda: _start_engine(TransferEngine(), self.host, protocol, device_name)
        self._engine, self._session_id = self._start()
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        # session -> one write at a time; an entry lives while a writer holds its lock, so
        # the table does not grow with every decode process a prefill has ever served
        self._peer_locks: weakref.WeakValueDictionary[str, _PeerLock] = (
            weakref.WeakValueDictionary()
        )
        self._abandoned = 0  # calls past their deadline still running inside the engine
        # nvlink_intra: one cudaMemcpyBatchAsync per call, no TCP queue (very large batches
        # have hung the driver's batch copy for others: kept to a few thousand)
        self.max_batch = max_batch or (
            NVLINK_BATCH if protocol == "nvlink_intra" else _engine_queue()
        )
        self._retries = 0
        self._renewals = 0

    @property
    def retries(self) -> int:
        with self._lock:
            return self._retries

    @classmethod
    def require_env(cls, options: Any) -> None:
        mooncake_env.require("the PD KV transport", options.timeout_s)
        if options.protocol == "nvlink_intra":
            # the engine installs its intra-node NVLink (CUDA IPC) transport, and only it,
            # when this is set at all; both sides set it (both run this protocol)
            os.environ.setdefault("MC_INTRANODE_NVLINK", "1")

    def peer_info(self) -> dict[str, Any]:
        return {"transport": self.name, "protocol": self.protocol}

    def add_peer(self, session_id: str, info: dict[str, Any]) -> None:
        super().add_peer(session_id, info)
        theirs = info.get("protocol", "tcp")
        if theirs != self.protocol:
            raise TransferError(
                f"the decode's Mooncake protocol is {theirs!r}, this prefill's "
                f"{self.protocol!r} (--kv-transfer-protocol must match)"
            )

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        status = self._engine.register_memory(ptr, nbytes)
        if status != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at {ptr:#x}")
        self._registered.append((ptr, nbytes))

    def write(self, session_id: str, writes: Sequence[Write], after: Any = None) -> None:
        if not writes:
            return
        if after is not None:
            after.synchronize()  # the engine reads device memory outside any CUDA stream
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
        deadline_s = self.timeout_s + total / MIN_BYTES_PER_S
        with peer_lock:
            deadline = time.monotonic() + deadline_s
            status = self._call(
                lambda: self._write_batches(session_id, writes, deadline),
                deadline_s=deadline_s,
                what=f"write of {total} bytes in {len(writes)} pieces to {session_id}",
            )
        if status != 0:
            raise TransferError(
                f"KV {total}-byte write in {len(writes)} pieces to {session_id} failed "
                f"(engine status {status}: peer dead, unreachable, or the addresses are not "
                "registered there; the engine's log on stderr says which)"
            )

    def _write_batches(self, session_id: str, writes: Sequence[Write], deadline: float) -> int:
        """Every write, in calls of at most ``max_batch`` pieces; a failed call is repeated
        (see the class) until ``deadline``. Returns the engine's status (0: all landed)."""
        window = self.max_batch
        backoff = RETRY_FIRST_S
        start = failed_singles = 0
        engine = self._engine
        while start < len(writes):
            if time.monotonic() >= deadline:  # abandoned by the caller: no new call
                return -1
            batch = writes[start : start + window]
            status = engine.batch_transfer_sync_write(
                session_id,
                [w.src_ptr for w in batch],
                [w.dst_ptr for w in batch],
                [w.nbytes for w in batch],
            )
            if status == 0:
                start += len(batch)
                backoff = RETRY_FIRST_S
                continue
            if time.monotonic() + backoff >= deadline or _refuses(session_id):
                return int(status)
            failed_singles += len(batch) == 1
            if failed_singles == RENEW_AFTER:  # the engine's lanes to it are stuck
                engine = self._renew(engine)
            window = max(1, min(window, len(batch)) // 2)
            with self._lock:
                self._retries += 1
            logger.debug(
                "KV write to %s: a call of %d pieces failed (status %s); again with %d in %.3f s",
                session_id,
                len(batch),
                status,
                window,
                backoff,
            )
            time.sleep(backoff)
            backoff = min(backoff * 2, RETRY_MAX_S)
        return 0

    def _renew(self, stuck: Any) -> Any:
        """A new engine in place of ``stuck`` (unless another writer renewed it already, or
        :data:`MAX_RENEWALS` were started), with the same memory registered. The old engine
        is kept alive: other calls may still run in it."""
        with self._lock:
            if self._engine is not stuck or self._renewals >= MAX_RENEWALS:
                return self._engine
            self._renewals += 1
            try:
                engine, session_id = self._start()
                for ptr, nbytes in self._registered:
                    if engine.register_memory(ptr, nbytes) != 0:
                        raise TransferError(f"could not register {nbytes} bytes at {ptr:#x}")
            except TransferError as err:
                logger.warning("KV transport: a new Mooncake engine did not start: %s", err)
                return stuck
            _ABANDONED_ENGINES.append(stuck)
            logger.warning(
                "KV transport: calls to a live peer kept failing; writes now go through a "
                "new Mooncake engine (%s, was %s)",
                session_id,
                self._session_id,
            )
            self._engine, self._session_id = engine, session_id
            return engine

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
        for ptr, _ in self._registered:
            engine.unregister_memory(ptr)
        self._registered.clear()


def _start_engine(engine: Any, host: str, protocol: str, device_name: str) -> tuple[Any, str]:
    """``engine`` initialized in P2P-handshake mode on ``host``, and its session id."""
    status = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if status != 0:
        raise TransferError(
            f"Mooncake engine did not start on {host} over {protocol} "
            f"(status {status}; its log on stderr says why)"
        )
    port = engine.get_rpc_port()
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
    return engine, f"{host}:{port}"


def _engine_queue() -> int:
    """The engine's per-peer queue as the environment sets it, at most :data:`MAX_BATCH`."""
    raw = os.environ.get(QUEUE_ENV, "")
    return min(int(raw), MAX_BATCH) if raw.isdigit() and int(raw) > 0 else MAX_BATCH


def _refuses(session_id: str) -> bool:
    """Whether the peer's handshake port refuses connections (its process is gone)."""
    host, _, port = session_id.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.2):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # slow or unreachable: not known dead, the deadline decides
        return False
