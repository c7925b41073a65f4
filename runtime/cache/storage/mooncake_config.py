"""Settings of the Mooncake store client and the checks made before connecting it."""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvflow.contract import KV_TRANSFER_PORT_RANGE, MOONCAKE_MASTER_METADATA_PORT

__all__ = ["MooncakeStoreConfig", "engine_env", "loopback_bind_address", "unreachable_endpoint"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """Client settings, as SGLang's ``mooncake_store`` config names them.

    ``local_hostname`` empty: ``$KVFLOW_POD_IP``, else 127.0.0.1.
    """

    master_server_address: str
    metadata_server: str
    local_hostname: str = ""
    global_segment_size: int = 256 * 2**20
    local_buffer_size: int = 64 * 2**20
    protocol: str = "tcp"
    device_name: str = ""
    retry_interval_s: float = 5.0

    @classmethod
    def resolve(cls, path: str = "", config_file: str | None = None) -> MooncakeStoreConfig:
        """From ``$KVFLOW_MOONCAKE_CONFIG``'s JSON and/or ``--hicache-storage-path``
        (``host:port`` of the master; its metadata server is then ``http://host:8080/metadata``
        unless the JSON names one). Both given and naming different masters is an error."""
        fields: dict[str, Any] = {}
        if config_file:
            with open(config_file) as handle:
                raw = json.load(handle)
            known = set(cls.__dataclass_fields__)
            fields = {key: value for key, value in raw.items() if key in known}
            unknown = sorted(set(raw) - known)
            if unknown:
                logger.warning("mooncake config %s: ignoring unknown keys %s", config_file, unknown)
        if path:
            master = fields.get("master_server_address")
            if master and master != path:
                raise ValueError(
                    f"--hicache-storage-path {path!r} and {config_file} "
                    f"(master_server_address {master!r}) name different Mooncake masters"
                )
            fields["master_server_address"] = path
        if not fields.get("master_server_address"):
            raise ValueError("the Mooncake store needs a master address (host:port)")
        if not fields.get("metadata_server"):
            host = fields["master_server_address"].rpartition(":")[0]
            fields["metadata_server"] = f"http://{host}:{MOONCAKE_MASTER_METADATA_PORT}/metadata"
        return cls(**fields)


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


def engine_env(retry_interval_s: float, hostname: str = "") -> dict[str, str]:
    """The client's transfer-engine knobs, each only where the user has not set it: its
    listening ports inside the contract's range (the NetworkPolicy opens exactly that), and,
    when ``hostname`` is a loopback address, ``MC_TCP_BIND_ADDRESS`` set to it.

    Why the last: with a metadata server the engine advertises to its peers not the local
    hostname it is given but ``MC_TCP_BIND_ADDRESS``, else the first address of an interface
    other than ``lo`` (Mooncake's ``TransferEngineImpl::init``, "new RPC mapping", and
    ``findLocalIpAddresses``), so peers of a client started on 127.0.0.1 would connect to,
    say, eth0's address. Any other hostname (a pod IP) leaves that choice to the engine."""
    low, high = KV_TRANSFER_PORT_RANGE
    timeout = str(max(1, math.ceil(retry_interval_s)))
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


def unreachable_endpoint(cfg: MooncakeStoreConfig, timeout_s: float = 1.0) -> str | None:
    """The first of the master's endpoints (RPC, HTTP metadata) refusing a TCP connection,
    or None when both accept."""
    metadata = urlsplit(cfg.metadata_server)
    endpoints = [cfg.master_server_address]
    if metadata.scheme in ("http", "https") and metadata.hostname:
        port = metadata.port or (443 if metadata.scheme == "https" else 80)
        endpoints.append(f"{metadata.hostname}:{port}")
    for endpoint in endpoints:
        host, _, port_text = endpoint.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port_text)), timeout_s).close()
        except (OSError, ValueError):
            return endpoint
    return None
