"""Fake nodes for kwok, and the kwok configuration that brings them and their pods to life."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from .config import FakeNodeSpec

__all__ = ["GPU_RESOURCE", "fake_node", "node_is_ready", "write_kwok_config"]

GPU_RESOURCE = "nvidia.com/gpu"


def fake_node(name: str, spec: FakeNodeSpec, annotation: tuple[str, str]) -> dict[str, Any]:
    """A Node object that kwok (selecting on `annotation`) will manage.

    No taint: every pod may land on these nodes, as on a cluster of real GPU nodes.
    Capacity is set at creation; kwok's node-initialize stage keeps it.
    """
    resources_ = {
        "cpu": spec.cpu,
        "memory": spec.memory,
        "pods": spec.pods,
        GPU_RESOURCE: str(spec.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {annotation[0]: annotation[1], "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "kvflow.dev/fake-node": "true",
            },
        },
        "spec": {},
        "status": {"capacity": resources_, "allocatable": dict(resources_)},
    }


def node_is_ready(node: dict[str, Any]) -> bool:
    """Ready condition True and no `not-ready` taint left, so the scheduler uses it."""
    conditions = node.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints", [])
    return ready and not any(t.get("key") == "node.kubernetes.io/not-ready" for t in taints)


def write_kwok_config(path: Path) -> Path:
    """Write kwok's `--config` file: the default node and pod stages (vendored from
    kwok, see data/kwok-stages.yaml) that make nodes Ready and pods Running/Ready."""
    stages = resources.files(__package__).joinpath("data/kwok-stages.yaml").read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stages)
    return path
