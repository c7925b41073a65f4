"""The seam between worker discovery and the router's worker set.

A discovery source (static flags, the Kubernetes API) turns what it sees into
:class:`WorkerSpec` values and tells a :class:`WorkerSink` about them. The router's worker
registry is the sink; it owns health, breakers and load. Sources never probe workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvflow import contract

__all__ = ["WorkerSink", "WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """One model server as discovery sees it.

    ``url`` is the API base (``http://127.0.0.1:8000``, no trailing slash) and the worker's
    identity; ``role`` is one of :data:`kvflow.contract.ROLES`; ``bootstrap_port`` is the
    prefill worker's KV bootstrap port (``None`` for other roles or when unknown).
    ``lora_adapters`` are the LoRA adapters the router keeps loaded there, (name, path)
    sorted by name; ``None``: the router manages none of the worker's adapters.
    """

    url: str
    role: str = "unified"
    bootstrap_port: int | None = None
    lora_adapters: tuple[tuple[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if self.role not in contract.ROLES:
            raise ValueError(f"role must be one of {contract.ROLES}, got {self.role!r}")
        if not self.url.startswith(("http://", "https://")) or self.url.endswith("/"):
            raise ValueError(
                f"worker URL must be http(s)://host:port without a slash: {self.url!r}"
            )


class WorkerSink(Protocol):
    """Receives the worker set's changes; called on the router's event loop thread."""

    def upsert(self, spec: WorkerSpec) -> None:
        """Add the worker, or update its role/bootstrap port if its URL is known."""

    def remove(self, url: str) -> None:
        """Drop the worker (in-flight requests to it finish or fail on their own)."""
