"""Helpers of the router's discovery tests: pods as the API's JSON, a recording sink."""

from __future__ import annotations

from typing import Any

from kvflow import contract
from kvflow.runtime.router.discovery import WorkerSpec


def pod(
    name: str = "w-0",
    role: str | None = "unified",
    ip: str | None = "127.0.0.11",
    ready: bool = True,
    ports: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the API's JSON, with the operator's labels and port names."""
    labels = {"kvflow.dev/deployment": "md"}
    if role is not None:
        labels[contract.ROLE_LABEL] = role
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    if ports is None:
        ports = [{"name": contract.API_PORT_NAME, "containerPort": 8100}]
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": labels,
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "runtime", "ports": ports}]},
        "status": status,
    }


class RecordingSink:
    """A WorkerSink that records calls and keeps the resulting worker set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.workers: dict[str, WorkerSpec] = {}

    def upsert(self, spec: WorkerSpec) -> None:
        self.calls.append(("upsert", spec.url))
        self.workers[spec.url] = spec

    def remove(self, url: str) -> None:
        self.calls.append(("remove", url))
        del self.workers[url]
