"""The one owner of Mooncake's process-wide environment (``MC_*``).

Mooncake's transfer engine reads its knobs from the environment once per process, on
first use, and one process may run two users of it: the PD KV transport and the HiCache
Mooncake store. Each user states what it needs with :func:`require`; this module merges
the needs (ports inside the contract's range; the longest of the asked timeouts, so no
user's transfers are cut short by another's; the loopback bind address when a user runs
on loopback) and writes the result, leaving alone every variable the user set before
kvflow did. The scheduler process states every need it will have before it starts any
engine (a need stated after the engine started is logged as not applied).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import sys
import threading

from kvflow.contract import KV_TRANSFER_PORT_RANGE

__all__ = ["engine_env", "loopback_bind_address", "require", "reset_for_tests"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_user_set: frozenset[str] | None = None  # MC_* names set before kvflow wrote any
_timeout_s = 0.0
_bind: str | None = None


def loopback_bind_address(hostname: str) -> str | None:
    """``hostname`` (a port after it ignored; ``localhost`` read as 127.0.0.1) when it is an
    IPv4 loopback address, else None. IPv6 ``::1`` gives None: the engine then listens on
    IPv4 only (without ``MC_USE_IPV6``), so advertising ``::1`` would make it unreachable."""
    host = hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return str(address) if address.version == 4 and address.is_loopback else None


def engine_env(timeout_s: float, hostname: str = "") -> dict[str, str]:
    """The knobs for one user: listening ports inside the contract's range (the
    NetworkPolicy opens exactly that), data and handshake timeouts of ``timeout_s``, and,
    when ``hostname`` is a loopback address, ``MC_TCP_BIND_ADDRESS`` set to it.

    Why the last: with a metadata server the engine advertises to its peers not the local
    hostname it is given but ``MC_TCP_BIND_ADDRESS``, else the first address of an interface
    other than ``lo`` (Mooncake's ``TransferEngineImpl::init``, "new RPC mapping", and
    ``findLocalIpAddresses``), so peers of a client started on 127.0.0.1 would connect to,
    say, eth0's address. Any other hostname (a pod IP) leaves that choice to the engine."""
    low, high = KV_TRANSFER_PORT_RANGE
    timeout = str(max(1, math.ceil(timeout_s)))
    env = {
        "MC_MIN_RPC_PORT": str(low),
        "MC_MAX_RPC_PORT": str(high),
        "MC_TCP_PROGRESS_TIMEOUT_SEC": timeout,
        "MC_HANDSHAKE_CONNECT_TIMEOUT": timeout,
    }
    bind = loopback_bind_address(hostname)
    if bind is not None:
        env["MC_TCP_BIND_ADDRESS"] = bind
    return env


def require(user: str, timeout_s: float, hostname: str = "") -> dict[str, str]:
    """State one user's needs; returns the merged ``MC_*`` values now in the environment
    (those the user set keep their value). ``user`` names it in log lines."""
    global _user_set, _timeout_s, _bind
    with _lock:
        if _user_set is None:
            _user_set = frozenset(k for k in os.environ if k.startswith("MC_"))
        _timeout_s = max(_timeout_s, timeout_s)
        _bind = _bind or loopback_bind_address(hostname)
        merged = engine_env(_timeout_s, _bind or "")
        for key, value in merged.items():
            if key in _user_set:
                continue
            if key in os.environ and os.environ[key] != value and _engine_started():
                logger.warning(
                    "%s asks for %s=%s, but a Mooncake engine already started with %s",
                    user,
                    key,
                    value,
                    os.environ[key],
                )
            os.environ[key] = value
        return {key: os.environ[key] for key in merged}


def _engine_started() -> bool:
    return "mooncake.engine" in sys.modules or "mooncake.store" in sys.modules


def reset_for_tests() -> None:
    """Forget every stated need (the environment is left as it is)."""
    global _user_set, _timeout_s, _bind
    with _lock:
        _user_set, _timeout_s, _bind = None, 0.0, None
