"""Settings of the Mooncake store client and the checks made before connecting it."""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvflow.contract import MOONCAKE_MASTER_METADATA_PORT

__all__ = ["MooncakeStoreConfig", "unreachable_endpoint"]

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
