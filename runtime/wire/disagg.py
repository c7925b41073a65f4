"""What crosses between a prefill and its decode: SGLang's bootstrap fields on each
request, and the prefill's result of a room."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Bootstrap", "PrefillResult", "pairing_problem"]


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


def pairing_problem(role: str, bootstrap: Bootstrap | None) -> str | None:
    """Why a request with (or without) bootstrap fields cannot run on a server of ``role``;
    None when it can. The one rule, checked at the HTTP edge and again on admission."""
    if role == "unified" and bootstrap is not None:
        return "this server runs the unified role: bootstrap_* fields are for PD servers"
    if role != "unified" and bootstrap is None:
        return (
            f"this server runs the {role} role: send requests through a PD router "
            "(bootstrap_host, bootstrap_port and bootstrap_room)"
        )
    return None


def _optional_float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _top_pairs(value: Any, name: str) -> tuple[tuple[int, float], ...] | None:
    if value is None:
        return None
    try:
        pairs = tuple((int(t), float(lp)) for t, lp in value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be [token_id, logprob] pairs") from err
    return pairs


@dataclass(frozen=True, kw_only=True)
class PrefillResult:
    """What a prefill hands its decode with a ``done`` room, besides the KV: the first
    token it sampled (``None`` when ``max_new_tokens`` is 0) and what the decode answers
    with it. Travels as JSON in the room's status (:meth:`to_json`, :meth:`from_json`)."""

    first_token: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    cached_tokens: int = 0
    input_logprobs: tuple[float | None, ...] | None = None  # complete prompt logprobs, if asked
    input_top_logprobs: tuple[Any, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "first_token": self.first_token,
            "logprob": self.logprob,
            "top_logprobs": None if self.top_logprobs is None else list(self.top_logprobs),
            "cached_tokens": self.cached_tokens,
            "input_logprobs": None if self.input_logprobs is None else list(self.input_logprobs),
            "input_top_logprobs": (
                None if self.input_top_logprobs is None else list(self.input_top_logprobs)
            ),
        }

    @classmethod
    def from_json(cls, body: Any, vocab_size: int) -> PrefillResult:
        """Parse a peer's result; ValueError names the first field that is not what this
        contract allows (a first token outside ``[0, vocab_size)`` included)."""
        if not isinstance(body, dict):
            raise ValueError("the prefill's result is not an object")
        token = body.get("first_token")
        if token is not None and (
            isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size
        ):
            raise ValueError(f"first_token {token!r} is outside the vocabulary [0, {vocab_size})")
        cached = body.get("cached_tokens") or 0
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"cached_tokens must be a count, got {cached!r}")
        inputs = body.get("input_logprobs")
        if inputs is not None:
            if not isinstance(inputs, list):
                raise ValueError("input_logprobs must be a list")
            inputs = tuple(_optional_float(v, "input_logprobs") for v in inputs)
        tops = body.get("input_top_logprobs")
        if tops is not None and not isinstance(tops, list):
            raise ValueError("input_top_logprobs must be a list")
        return cls(
            first_token=token,
            logprob=_optional_float(body.get("logprob"), "logprob"),
            top_logprobs=_top_pairs(body.get("top_logprobs"), "top_logprobs"),
            cached_tokens=cached,
            input_logprobs=inputs,
            input_top_logprobs=None if tops is None else tuple(tops),
        )
