"""Pods that run this machine's kvflow checkout from the host base image.

`HOST_BASE_IMAGE` holds no programs: a pod mounts, read-only and at the same paths, the
host's `/usr`, the Python installation the virtual environment was made from, the
checkout, and the virtual environment (when it lives elsewhere). `kvflow` is then on the
pod's PATH exactly as in the shell that runs the tests.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from .config import REAL_NODE_LABEL, REAL_NODE_TAINT

__all__ = ["HostRuntime", "api_server_env", "real_node_placement"]

_REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class HostRuntime:
    """Host paths a pod mounts to run kvflow: the checkout, its venv and Python."""

    repo: Path
    venv: Path
    python_prefix: Path

    @classmethod
    def current(cls) -> HostRuntime:
        """The checkout these tests run from, with the interpreter running them."""
        return cls(
            repo=_REPO,
            venv=Path(sys.prefix).resolve(),
            python_prefix=Path(sys.base_prefix).resolve(),
        )

    def _paths(self) -> dict[str, Path]:
        paths = {
            "host-usr": Path("/usr"),
            "host-python": self.python_prefix,
            "host-repo": self.repo,
        }
        if self.repo not in self.venv.parents:
            paths["host-venv"] = self.venv
        return paths

    def volumes(self) -> list[dict[str, Any]]:
        return [
            {"name": name, "hostPath": {"path": str(path), "type": "Directory"}}
            for name, path in self._paths().items()
        ]

    def mounts(self) -> list[dict[str, Any]]:
        return [
            {"name": name, "mountPath": str(path), "readOnly": True}
            for name, path in self._paths().items()
        ]

    def env(self) -> list[dict[str, Any]]:
        """PATH with the venv first; no bytecode written into the read-only checkout."""
        path = f"{self.venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"
        return [
            {"name": "PATH", "value": path},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
            {"name": "HOME", "value": "/tmp"},
        ]


def api_server_env(kubeconfig: Path) -> list[dict[str, Any]]:
    """In-cluster client settings pointing at the apiserver's loopback address.

    The `kubernetes` Service's ClusterIP has no proxy behind it here (no kube-proxy, and
    EndpointSlices refuse loopback), so host-network pods reach the API where it listens;
    its serving certificate names 127.0.0.1. Container env wins over the Service env the
    kubelet injects.
    """
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    parts = urlsplit(server)
    return [
        {"name": "KUBERNETES_SERVICE_HOST", "value": parts.hostname},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(parts.port)},
    ]


def real_node_placement(label_value: str = "true") -> dict[str, Any]:
    """`nodeSelector` and `tolerations` that put a pod on the (tainted) real node: the
    host-network one, or with `label_value` the node carrying it (a pod-network node's
    `RealNodeConfig.label_value`)."""
    return {
        "nodeSelector": {REAL_NODE_LABEL: label_value},
        "tolerations": [{**REAL_NODE_TAINT, "value": label_value, "operator": "Equal"}],
    }
