"""KV transport between processes of one host through CUDA IPC: the prefill maps the
decode's KV buffers into its own address space once and copies pages with the GPU.

- Reach: the decode exports each registered buffer's allocation (:mod:`ipc_handles`) in
  its :meth:`~CudaIpcTransport.peer_info`, which travels in the bootstrap registration;
  the prefill checks it came from this host (the kernel's boot id), maps every buffer on
  first use and checks the mapped sizes against what the decode advertised.
- Copy: a write's pieces become one gather and one scatter per (K or V) buffer pair
  (:func:`~kvflow.runtime.disagg.transport.piece_copy.copy_pieces`) on the writing
  thread's current stream, the legacy default stream of the prefill's device: it runs
  after the prefill's forward passes that made the KV (same stream), and :meth:`write`
  returns once the copy finished (the stream is synchronized). The decode zeroes a
  request's slots before it claims them and waits for that (``KVPool.zero_slots``), so
  the copy never races the zeroing.
- Both processes must see the decode's GPU (one GPU shared by prefill and decode, or the
  prefill given both). In Kubernetes two pods see only their own GPUs: this transport is
  for processes of one pod or of ``kvflow up`` on one machine (docs/disaggregation.md).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvflow.runtime.disagg.plan import Write
from kvflow.runtime.disagg.transport import ipc_handles
from kvflow.runtime.disagg.transport.base import KVTransport, TransferError
from kvflow.runtime.disagg.transport.piece_copy import Buffers, copy_pieces

__all__ = ["CudaIpcTransport", "host_identity"]

logger = logging.getLogger(__name__)

MAX_PEERS = 64  # mapped decodes; the least recently registered beyond that is unmapped


def host_identity() -> str:
    """This machine's kernel boot id: equal in every process and container of one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown-host"


class _DeviceBytes:
    """A device address range as ``__cuda_array_interface__`` (torch wraps it, no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def _bytes_at(ptr: int, nbytes: int) -> torch.Tensor:
    return torch.as_tensor(_DeviceBytes(ptr, nbytes), device="cuda")


class _Peer:
    """A decode's advertised buffers; mapped into this process on first write."""

    def __init__(self, info: dict[str, Any]) -> None:
        raw = info.get("buffers")
        if not isinstance(raw, list) or not raw:
            raise ValueError("cuda_ipc peer info has no buffers")
        self.advertised: list[tuple[int, ipc_handles.Exported]] = []
        for item in raw:
            if not isinstance(item, dict):
                raise ValueError("a cuda_ipc buffer must be an object")
            addr, handle = int(item["addr"]), str(item["handle"])
            offset, nbytes = int(item["offset"]), int(item["nbytes"])
            if min(addr, offset) < 0 or nbytes <= 0:
                raise ValueError("a cuda_ipc buffer has a negative address or no bytes")
            self.advertised.append((addr, ipc_handles.Exported(handle, offset, nbytes)))
        self.buffers: Buffers | None = None
        self._bases: list[int] = []

    def mapped(self) -> Buffers:
        if self.buffers is None:
            tensors, opened = [], {}  # the peer's allocation (its base there) -> base here
            try:
                for addr, exported in self.advertised:
                    block = addr - exported.offset  # buffers may share an allocation
                    if block not in opened:
                        opened[block] = ipc_handles.open_handle(exported.handle)
                    base = opened[block]
                    size = ipc_handles.mapped_size(base)
                    if exported.offset + exported.nbytes > size:
                        raise TransferError(
                            f"the decode advertised {exported.nbytes} bytes at offset "
                            f"{exported.offset} of an allocation of {size}"
                        )
                    tensors.append(_bytes_at(base + exported.offset, exported.nbytes))
            except (OSError, ValueError) as err:
                self._bases = list(opened.values())
                self.close()
                raise TransferError(f"could not map the decode's KV buffers: {err}") from err
            self._bases = list(opened.values())
            self.buffers = Buffers(tuple(a for a, _ in self.advertised), tuple(tensors))
        return self.buffers

    def close(self) -> None:
        self.buffers = None
        for base in self._bases:
            try:
                ipc_handles.close(base)
            except OSError as err:
                logger.warning("unmapping a decode's KV buffer failed: %s", err)
        self._bases = []


class CudaIpcTransport(KVTransport):
    """KV writes between processes of one host by CUDA IPC (see the module docstring).

    Bound of :meth:`write`: the copy of its bytes at device speed (no network, no peer
    process involved); it raises :class:`TransferError` for a peer that did not register,
    cannot be mapped, or a piece outside the peer's advertised buffers.
    """

    name = "cuda_ipc"

    def __init__(
        self,
        protocol: str = "cuda_ipc",
        device_name: str = "",
        host: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        if not torch.cuda.is_available():
            raise TransferError("the cuda_ipc KV transport needs a CUDA device")
        self.host = host_identity()
        self.device = torch.cuda.current_device()
        self.timeout_s = timeout_s
        self._session_id = f"cuda_ipc:{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self._local: dict[int, torch.Tensor] = {}  # registered address -> its bytes
        self._exported: list[dict[str, Any]] = []
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    @classmethod
    def require_env(cls, options: Any) -> None:
        """Nothing process-wide: the driver API needs no settings."""

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        try:
            ipc_handles.bind_context(self.device)
            exported = ipc_handles.export(ptr, nbytes)
        except OSError as err:
            raise TransferError(
                f"cannot export {nbytes} bytes at {ptr:#x} by CUDA IPC: {err}"
            ) from err
        self._local[ptr] = _bytes_at(ptr, nbytes)
        self._exported.append({"addr": ptr, **exported._asdict()})

    def peer_info(self) -> dict[str, Any]:
        return {"transport": self.name, "host": self.host, "buffers": list(self._exported)}

    def add_peer(self, session_id: str, info: dict[str, Any]) -> None:
        super().add_peer(session_id, info)
        if info.get("host") != self.host:
            raise TransferError(
                "the decode runs on another host (cuda_ipc reaches processes of one host "
                "only; use --disaggregation-transfer-backend mooncake)"
            )
        peer = _Peer(info)
        with self._lock:
            old = self._peers.pop(session_id, None)
            self._peers[session_id] = peer
            dropped = list(self._peers)[:-MAX_PEERS]
            gone = [self._peers.pop(s) for s in dropped]
        for stale in [p for p in (old, *gone) if p is not None]:
            stale.close()

    def write(self, session_id: str, writes: Sequence[Write]) -> None:
        if not writes:
            return
        with self._lock:
            peer = self._peers.get(session_id)
        if peer is None:
            raise TransferError(f"KV transfer session {session_id!r} is not registered here")
        torch.cuda.set_device(self.device)
        ipc_handles.bind_context(self.device)  # the driver calls act on this thread's context
        local = Buffers(tuple(self._local), tuple(self._local.values()))
        with self._lock:  # one mapping per peer, made once
            remote = peer.mapped()
        copy_pieces(writes, local, remote)
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
        self._local.clear()
