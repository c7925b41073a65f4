"""How a prefill or decode moves its KV: one frozen options type, built from the flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.runtime.disagg.transport.base import KVTransport
from kvflow.runtime.disagg.transport.registry import KV_TRANSPORTS

__all__ = ["KVTransferOptions"]


@dataclass(frozen=True, kw_only=True)
class KVTransferOptions:
    """The transport (a name in ``KV_TRANSPORTS``, SGLang's
    ``--disaggregation-transfer-backend``) with all of its options, and the prefill's
    bootstrap endpoint (``bootstrap_port`` 0: any free port) with its credential
    (``internal_key``: the prefill requires it, the decode sends it; None: open routes)."""

    backend: str = "mooncake"
    protocol: str = "tcp"
    timeout_s: float = 5.0  # a peer without progress this long fails its requests
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    internal_key: str | None = field(default=None, repr=False)  # kept out of logs

    def require_env(self) -> None:
        """State the transport's process-wide settings before any engine starts."""
        KV_TRANSPORTS.get(self.backend).require_env(self)  # type: ignore[attr-defined]

    def transport(self) -> KVTransport:
        return KV_TRANSPORTS.get(self.backend)(protocol=self.protocol, timeout_s=self.timeout_s)
