"""KV transport between processes of one host through CUDA IPC: the prefill maps the
decode's KV buffers into its own address space once and copies pages with the GPU.

- Reach: the decode shares each K and V buffer the way ``torch.multiprocessing`` shares a
  CUDA tensor (``UntypedStorage._share_cuda_``: the IPC handle of the caching allocator's
  block, the storage's offset in it, torch's cross-process reference count), in its
  :meth:`~CudaIpcTransport.peer_info`, which travels in the bootstrap registration; the
  prefill checks it came from this host (the kernel's boot id) and a GPU it can see (by
  UUID) and reach by peer access, opens every buffer on first use in its own GPU's context (``UntypedStorage._new_shared_cuda``) and checks
  each against the allocation the driver really mapped (a peer's sizes are claims).
- Copy: a plan of slot runs (:meth:`~CudaIpcTransport.write_plan`, what the prefill
  sends) is one kernel for every layer's K and V buffer
  (:func:`~kvflow.kernels.row_runs.copy_slot_runs`), launched on the prefill's GPU and
  writing the decode's memory directly, over NVLink when that is another GPU (the
  decode's buffers are opened in the prefill GPU's context, which maps them there with
  peer access); byte-range writes (:meth:`~CudaIpcTransport.write`) become one gather and
  one scatter per buffer pair
  (:func:`~kvflow.runtime.disagg.transport.piece_copy.copy_pieces`). Both run on a copy
  stream of the writing thread, which first waits for the event the prefill recorded after
  the forward pass that made the KV (``after``): the copy overlaps the next chunk's
  forward pass instead of queueing behind it. A write returns once the copy finished. The
  decode zeroes a
  request's slots before it claims them and waits for that (``KVPool.zero_slots``), so
  the copy never races the zeroing.
- Both processes must see the decode's GPU (one GPU shared by prefill and decode, or the
  prefill given both). In Kubernetes two pods see only their own GPUs: this transport is
  for processes of one pod or of ``kvflow up`` on one machine (docs/disaggregation.md).
"""

from __future__ import annotations

import base64
import logging
import os
import re
import secrets
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvflow.kernels.row_runs import copy_slot_runs
from kvflow.runtime.disagg.plan import SlotPlan, Write
from kvflow.runtime.disagg.transport import cuda_driver
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


_REF_NAME = re.compile(r"/?[A-Za-z0-9_.-]{1,200}")  # torch's reference-count file names


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(value: Any, what: str) -> bytes:
    """A handle or name torch made (an IPC handle is 64 bytes, with torch's own prefix)."""
    raw = base64.b64decode(str(value), validate=True)
    if not 0 < len(raw) <= 256:
        raise ValueError(f"{what} of {len(raw)} bytes is not one torch makes")
    return raw


class _Shared(NamedTuple):
    """One buffer as the decode shares it (see :func:`share`), checked for types."""

    addr: int
    nbytes: int
    gpu: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    byte_offset: int
    ref: bytes
    ref_offset: int
    event: bytes
    event_sync: bool


def share(buffer: torch.Tensor) -> dict[str, Any]:
    """What a peer process needs to open ``buffer`` (contiguous, on CUDA)."""
    (device, handle, size, offset, ref, ref_offset, event, event_sync) = (
        buffer.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    )
    return {
        "addr": buffer.data_ptr(),
        "nbytes": buffer.numel() * buffer.element_size(),
        "gpu": str(torch.cuda.get_device_properties(device).uuid),
        "handle": _b64(handle),
        "storage_bytes": size,
        "storage_offset": offset,
        "byte_offset": buffer.storage_offset() * buffer.element_size(),
        "ref": _b64(ref),
        "ref_offset": ref_offset,
        "event": _b64(event),
        "event_sync": bool(event_sync),
    }


def _local_device(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise TransferError(
        f"the decode's GPU {uuid} is not visible to this prefill (cuda_ipc needs the "
        "prefill to see the decode's GPU: one GPU shared, or both in CUDA_VISIBLE_DEVICES)"
    )


class _Peer:
    """A decode's advertised buffers; opened in this process on first write."""

    def __init__(self, info: dict[str, Any]) -> None:
        raw = info.get("buffers")
        if not isinstance(raw, list) or not raw:
            raise ValueError("cuda_ipc peer info has no buffers")
        self.advertised: list[_Shared] = []
        for item in raw:
            if not isinstance(item, dict):
                raise ValueError("a cuda_ipc buffer must be an object")
            ref = _unb64(item["ref"], "a reference-count name")
            if not _REF_NAME.fullmatch(ref.decode("ascii", "replace")):
                raise ValueError("a cuda_ipc reference-count name is not one torch makes")
            entry = _Shared(
                addr=int(item["addr"]),
                nbytes=int(item["nbytes"]),
                gpu=str(item["gpu"]),
                handle=_unb64(item["handle"], "a CUDA IPC handle"),
                storage_bytes=int(item["storage_bytes"]),
                storage_offset=int(item["storage_offset"]),
                byte_offset=int(item["byte_offset"]),
                ref=ref,
                ref_offset=int(item["ref_offset"]),
                event=_unb64(item["event"], "a CUDA IPC event handle"),
                event_sync=bool(item["event_sync"]),
            )
            if min(entry.addr, entry.storage_offset, entry.byte_offset) < 0:
                raise ValueError("a cuda_ipc buffer has a negative address or offset")
            if entry.nbytes <= 0 or entry.byte_offset + entry.nbytes > entry.storage_bytes:
                raise ValueError("a cuda_ipc buffer does not fit its storage")
            self.advertised.append(entry)
        self.buffers: Buffers | None = None

    def mapped(self, device: int) -> Buffers:
        """The decode's buffers mapped into GPU ``device``'s address space (this process's
        GPU: its kernels write them directly, over NVLink when they live on another GPU:
        ``cudaIpcOpenMemHandle`` in this GPU's context enables peer access)."""
        if self.buffers is None:
            tensors = []
            try:
                for item in self.advertised:
                    owner = _local_device(item.gpu)
                    if owner != device and not torch.cuda.can_device_access_peer(device, owner):
                        raise TransferError(
                            f"GPU {device} cannot access GPU {owner}'s memory (no peer "
                            "access between them): cuda_ipc needs NVLink or PCIe peer access"
                        )
                    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                        device,
                        item.handle,
                        item.storage_bytes,
                        item.storage_offset,
                        item.ref,
                        item.ref_offset,
                        item.event,
                        item.event_sync,
                    )
                    start = storage.data_ptr() + item.byte_offset
                    base, size = cuda_driver.allocation_range(start)
                    if start + item.nbytes > base + size:
                        raise TransferError(
                            f"the decode advertised {item.nbytes} bytes at offset "
                            f"{start - base} of an allocation of {size}"
                        )
                    view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
                    tensors.append(view.set_(storage, item.byte_offset, (item.nbytes,), (1,)))
            except (OSError, RuntimeError, ValueError) as err:
                raise TransferError(f"could not map the decode's KV buffers: {err}") from err
            self.buffers = Buffers(tuple(i.addr for i in self.advertised), tuple(tensors))
        return self.buffers

    def close(self) -> None:
        self.buffers = None  # torch unmaps once the last storage of a block is gone


def _buffer_pairs(plan: SlotPlan, local: Buffers, remote: Buffers) -> list[tuple[Any, Any]]:
    """The (local, mapped peer) tensor of every buffer the plan names, each checked to hold
    the layout's slots (the slots were checked against the layouts by ``slot_plan``)."""
    found: list[tuple[Any, Any]] = []
    need = plan.src.buffer_bytes, plan.dst.buffer_bytes
    for src_addr, dst_addr in plan.buffers():
        pair = []
        for side, addr, buffers, size in (
            ("source", src_addr, local, need[0]),
            ("destination", dst_addr, remote, need[1]),
        ):
            try:
                tensor = buffers.tensors[buffers.addrs.index(addr)]
            except ValueError:
                raise TransferError(f"no registered {side} buffer at {addr:#x}") from None
            if tensor.numel() < size:
                raise TransferError(
                    f"the {side} buffer at {addr:#x} holds {tensor.numel()} bytes, "
                    f"the layout says {size}"
                )
            pair.append(tensor)
        found.append((pair[0], pair[1]))
    return found


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
        self._local = Buffers((), ())  # the registered buffers' bytes, by address
        self._exported: list[dict[str, Any]] = []
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._streams = threading.local()

    @classmethod
    def require_env(cls, options: Any) -> None:
        """Nothing process-wide: the driver API needs no settings."""

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        raise TransferError("the cuda_ipc transport shares tensors: use register_buffer")

    def register_buffer(self, buffer: Any) -> None:
        if not (isinstance(buffer, torch.Tensor) and buffer.is_cuda and buffer.is_contiguous()):
            raise TransferError("cuda_ipc registers contiguous CUDA tensors only")
        flat = buffer.view(-1).view(torch.uint8)
        self._local = Buffers((*self._local.addrs, buffer.data_ptr()), (*self._local.tensors, flat))
        self._exported.append(share(buffer))

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

    def write(self, session_id: str, writes: Sequence[Write], after: Any = None) -> None:
        if not writes:
            return
        remote = self._remote(session_id)
        stream = self._stream()
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            copy_pieces(writes, self._local, remote)
        stream.synchronize()

    def write_plan(self, session_id: str, plan: SlotPlan, after: Any = None) -> None:
        """The plan's runs in every K and V buffer: one kernel on this GPU writing the
        decode's memory (mapped into this GPU's address space); an EAGLE target's features
        (rows of another size) after it as pieces, on the same stream."""
        if not plan.counts.size:
            return
        remote = self._remote(session_id)
        pairs = _buffer_pairs(plan, self._local, remote)
        addresses = [t.data_ptr() for pair in zip(*pairs, strict=True) for t in pair]
        word = 8
        while any(a % word for a in addresses) or plan.src.slot_bytes % word:
            word //= 2
        table = np.concatenate(
            (np.asarray(addresses, dtype=np.int64), plan.src_starts, plan.dst_starts, plan.counts)
        )
        # pinned: a pageable copy would wait for the stream's earlier work
        host = torch.from_numpy(table).pin_memory()
        stream = self._stream()
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            on_device = host.to(f"cuda:{self.device}", non_blocking=True)
            copy_slot_runs(on_device, len(pairs), plan.src.slot_bytes, int(plan.counts.max()), word)
            features = plan.feature_writes()
            if features:
                copy_pieces(features, self._local, remote)
        stream.synchronize()

    def _remote(self, session_id: str) -> Buffers:
        """The peer's buffers, mapped on first use; this thread bound to this GPU."""
        with self._lock:
            peer = self._peers.get(session_id)
        if peer is None:
            raise TransferError(f"KV transfer session {session_id!r} is not registered here")
        torch.cuda.set_device(self.device)
        cuda_driver.bind_context(self.device)  # the driver calls act on this thread's context
        with self._lock:  # one mapping per peer, made once
            return peer.mapped(self.device)

    def _stream(self) -> torch.cuda.Stream:
        """This thread's copy stream: beside the forward passes, ordered after the one that
        made the bytes by ``after``."""
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        return stream

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
        self._local = Buffers((), ())
