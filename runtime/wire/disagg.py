"""What a disaggregated request carries: SGLang's bootstrap fields."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Bootstrap"]


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's KV comes from (decode) or goes to (prefill): the prefill worker's
    ``bootstrap_host`` and ``bootstrap_port``, and the ``bootstrap_room`` that pairs the two
    halves of one request (a random 63-bit integer chosen by the router)."""

    host: str
    port: int
    room: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("bootstrap_host must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"bootstrap_port must be a TCP port, got {self.port}")
        if not 0 <= self.room < 1 << 64:
            raise ValueError(f"bootstrap_room must be in [0, 2**64), got {self.room}")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def sample(self, index: int) -> Bootstrap:
        """The pairing of sample ``index`` of an ``n > 1`` request: room ``room + index``
        (as SGLang gives each parallel sample its own room). Both halves derive the same
        rooms from the one the router chose."""
        return self if index == 0 else replace(self, room=self.room + index)
