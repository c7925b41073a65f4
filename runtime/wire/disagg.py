"""What crosses between a prefill and its decode: SGLang's bootstrap fields on each
request, and the prefill's result of a room."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

__all__ = ["Bootstrap", "PrefillResult", "pairing_problem", "prompt_hash"]


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's KV comes from (decode) or goes to (prefill): the prefill worker's
    ``bootstrap_host`` and ``bootstrap_port``, and the ``bootstrap_room`` that pairs the two
    halves of one request (a random 63-bit integer chosen by the router)."""

    host: str
    port: int
    room: int
    token: str | None = field(default=None, compare=False, repr=False)  # see pair_token

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


def prompt_hash(input_ids: Sequence[int]) -> str:
    """The fingerprint of a prompt's token ids that a decode's claim carries: the prefill
    sends a room's KV only to a claim whose prompt is its request's (BLAKE2b-128, hex)."""
    return hashlib.blake2b(
        struct.pack(f"<{len(input_ids)}q", *input_ids), digest_size=16
    ).hexdigest()


def _logprob(value: Any, name: str) -> float | None:
    """A logprob from a peer: None, or a number that is not NaN nor +inf (-inf is a token
    a grammar forbade)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or value == math.inf:
        raise ValueError(f"{name} must be a logprob, got {value!r}")
    return float(value)


def _token(value: Any, vocab_size: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"{name} {value!r} is outside the vocabulary [0, {vocab_size})")
    return value


def _top_pairs(value: Any, vocab_size: int, name: str) -> tuple[tuple[int, float], ...] | None:
    """``[[token_id, logprob], ...]`` (or None), every token in the vocabulary."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(
        isinstance(pair, list | tuple) and len(pair) == 2 for pair in value
    ):
        raise ValueError(f"{name} must be [token_id, logprob] pairs")
    pairs = []
    for token, logprob in value:
        if logprob is None:
            raise ValueError(f"{name} must be [token_id, logprob] pairs")
        pairs.append((_token(token, vocab_size, name), cast(float, _logprob(logprob, name))))
    return tuple(pairs)


def _input_logprobs(body: dict[str, Any], vocab_size: int) -> tuple[Any, Any]:
    """``input_logprobs`` (numbers or None, one per position) and ``input_top_logprobs``
    (None, or one entry per position: None or pairs)."""
    values, tops = body.get("input_logprobs"), body.get("input_top_logprobs")
    if values is None:
        if tops is not None:
            raise ValueError("input_top_logprobs without input_logprobs")
        return None, None
    if not isinstance(values, list):
        raise ValueError("input_logprobs must be a list")
    parsed = tuple(_logprob(v, "input_logprobs") for v in values)
    if tops is None:
        return parsed, None
    if not isinstance(tops, list) or len(tops) != len(values):
        raise ValueError("input_top_logprobs must be a list, one entry per input logprob")
    return parsed, tuple(_top_pairs(top, vocab_size, "input_top_logprobs") for top in tops)


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
    def from_json(cls, body: Any, vocab_size: int, *, wants_token: bool = True) -> PrefillResult:
        """Parse a peer's result; ValueError names the first field that is not what this
        contract allows: a first token outside ``[0, vocab_size)``, none for a request that
        wants one (``max_new_tokens`` > 0) or one for a request that wants none, logprobs
        that are not numbers, top logprobs of tokens outside the vocabulary. Unknown fields
        are ignored."""
        if not isinstance(body, dict):
            raise ValueError("the prefill's result is not an object")
        token = body.get("first_token")
        if token is None:
            if wants_token:
                raise ValueError("no first_token for a request with max_new_tokens > 0")
        elif not wants_token:
            raise ValueError("a first_token for a request with max_new_tokens 0")
        else:
            token = _token(token, vocab_size, "first_token")
        cached = body.get("cached_tokens") or 0
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"cached_tokens must be a count, got {cached!r}")
        inputs, tops = _input_logprobs(body, vocab_size)
        return cls(
            first_token=token,
            logprob=_logprob(body.get("logprob"), "logprob"),
            top_logprobs=_top_pairs(body.get("top_logprobs"), vocab_size, "top_logprobs"),
            cached_tokens=cached,
            input_logprobs=inputs,
            input_top_logprobs=tops,
        )
