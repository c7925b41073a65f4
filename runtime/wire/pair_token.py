"""Which prefill a decode may contact: PD pair tokens signed by the router, and a static list.

SGLang's bootstrap fields name the prefill a decode fetches its KV from, and any client of
the decode could name any address. A decode therefore contacts a prefill only when

- the request carries a ``bootstrap_token`` that this deployment's router signed with the
  internal key (``$KVFLOW_INTERNAL_KEY``, shared by router and workers, never by
  clients) over the room, the prefill's bootstrap address and an expiry; or
- the prefill's bootstrap address is one the decode was started with
  (``--disaggregation-trusted-prefills HOST:PORT ...``: SGLang's router, which cannot
  sign, in front of a static set of prefills).

Token: ``v1.<expiry, unix seconds>.<hex HMAC-SHA256>`` over ``v1|room|host|port|expiry``.
A batch carries one token per prompt, as it carries one room per prompt; the ``n``
samples of a prompt use rooms derived from the signed one (``Bootstrap.sample``).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

from kvflow.runtime.wire.disagg import Bootstrap

__all__ = ["TOKEN_TTL_S", "PairTrust", "sign_pair"]

TOKEN_TTL_S = 300.0  # router -> worker in flight, plus clock skew between pods
_VERSION = "v1"


def _mac(key: str, room: int, host: str, port: int, expiry: int) -> str:
    message = f"{_VERSION}|{room}|{host}|{port}|{expiry}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def sign_pair(key: str, bootstrap: Bootstrap, now: float | None = None) -> str:
    """The router's token for one pair: valid for :data:`TOKEN_TTL_S` seconds."""
    expiry = int((time.time() if now is None else now) + TOKEN_TTL_S)
    return (
        f"{_VERSION}.{expiry}.{_mac(key, bootstrap.room, bootstrap.host, bootstrap.port, expiry)}"
    )


@dataclass(frozen=True)
class PairTrust:
    """A decode's rule for the prefills it contacts (see the module docstring)."""

    key: str | None = None
    trusted: frozenset[str] = frozenset()  # bootstrap addresses, "host:port"

    @property
    def configured(self) -> bool:
        return bool(self.key) or bool(self.trusted)

    def problem(self, bootstrap: Bootstrap, token: object, now: float | None = None) -> str | None:
        """Why the decode must not contact ``bootstrap``'s prefill; None when it may."""
        if f"{bootstrap.host}:{bootstrap.port}" in self.trusted:
            return None
        if not self.key:
            return (
                f"bootstrap {bootstrap.address} is not a trusted prefill of this decode "
                "(--disaggregation-trusted-prefills)"
            )
        if token is None:
            return (
                f"bootstrap {bootstrap.address} is not a trusted prefill: send requests "
                "through this deployment's router (it signs each pair: bootstrap_token)"
            )
        if not isinstance(token, str) or token.count(".") != 2:
            return "bootstrap_token is malformed"
        version, expiry_text, mac = token.split(".")
        if version != _VERSION or not expiry_text.isdigit():
            return "bootstrap_token is malformed"
        expiry = int(expiry_text)
        expected = _mac(self.key, bootstrap.room, bootstrap.host, bootstrap.port, expiry)
        if not hmac.compare_digest(mac, expected):
            return f"bootstrap_token does not match room {bootstrap.room} at {bootstrap.address}"
        if expiry < (time.time() if now is None else now):
            return "bootstrap_token has expired"
        return None
