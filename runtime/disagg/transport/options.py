"""How a prefill or decode moves its KV: one frozen options type, built from the flags."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.runtime.disagg.transport.base import KVTransport
from kvflow.runtime.disagg.transport.registry import KV_TRANSPORTS

__all__ = ["KV_TRANSFER_PROTOCOLS", "KVTransferOptions", "transport_problem"]

# Mooncake's protocols kvflow offers (--kv-transfer-protocol): tcp (any two hosts), rdma
# (never run here), nvlink_intra (Mooncake's CUDA IPC between processes of one host).
KV_TRANSFER_PROTOCOLS = ("tcp", "rdma", "nvlink_intra")


def transport_problem(
    backend: str, protocol: str | None, hicache_storage: str | None, cuda: Callable[[], bool]
) -> str | None:
    """Why a prefill's or decode's transport settings cannot work, or None; ``cuda`` tells
    whether this process will run on CUDA (asked only when it matters)."""
    if backend == "cuda_ipc":
        if protocol is not None:
            return (
                "--kv-transfer-protocol is Mooncake's (tcp, rdma, nvlink_intra); the "
                "cuda_ipc backend has none"
            )
        if not cuda():
            return (
                "--disaggregation-transfer-backend cuda_ipc copies KV between GPUs of one "
                "host: it needs CUDA (use mooncake on CPU)"
            )
    if protocol == "nvlink_intra":
        if hicache_storage == "mooncake":
            return (
                "--kv-transfer-protocol nvlink_intra makes every Mooncake engine of the "
                "process NVLink-only (MC_INTRANODE_NVLINK), so --hicache-storage mooncake "
                "could not reach its store; use tcp with it"
            )
        if not cuda():
            return (
                "--kv-transfer-protocol nvlink_intra needs CUDA and the "
                "mooncake-transfer-engine CUDA wheel"
            )
    return None


@dataclass(frozen=True, kw_only=True)
class KVTransferOptions:
    """The transport (a name in ``KV_TRANSPORTS``, SGLang's
    ``--disaggregation-transfer-backend``) with all of its options, and the prefill's
    bootstrap endpoint (``bootstrap_port`` 0: any free port) with its credential
    (``internal_key``: the prefill requires it, the decode sends it; None: open routes).
    ``timeout_s`` bounds a peer's silence (``--disagg-timeout``); ``bootstrap_timeout_s``
    (SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``) bounds how long a prefill keeps a
    room whose other half has not come yet."""

    backend: str = "mooncake"
    protocol: str = "tcp"
    timeout_s: float = 5.0  # a peer without progress this long fails its requests
    # the prefill's wait for a room's halves to meet (a decode short of KV claims late)
    bootstrap_timeout_s: float = 300.0
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    internal_key: str | None = field(default=None, repr=False)  # kept out of logs

    def require_env(self) -> None:
        """State the transport's process-wide settings before any engine starts."""
        KV_TRANSPORTS.get(self.backend).require_env(self)  # type: ignore[attr-defined]

    def transport(self) -> KVTransport:
        return KV_TRANSPORTS.get(self.backend)(protocol=self.protocol, timeout_s=self.timeout_s)
