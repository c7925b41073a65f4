"""A self-contained admin kubeconfig (certificates embedded, no file references)."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from .certs import Pki

__all__ = ["write_kubeconfig"]


def write_kubeconfig(path: Path, server: str, pki: Pki, name: str = "kvflow") -> Path:
    """Write a kubeconfig for `server` with the admin client cert; return `path`.

    Data is embedded so the file keeps working when copied, and so that every
    client (kubectl, helm, kopf, the Python client) reads it the same way.
    """

    def b64(file: Path) -> str:
        return base64.b64encode(file.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_crt)},
            }
        ],
        "users": [
            {
                "name": f"{name}-admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_crt),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": f"{name}-admin"}}],
        "current-context": name,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
