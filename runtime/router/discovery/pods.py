"""Kubernetes pods as workers: which pod is a worker, at what URL, and the worker set they make.

Pure code, no client and no cluster: pods are the API's JSON objects (camelCase dicts, as
``kubectl get pod -o json`` prints them), so the rules are testable on literals. The names
they read come from :mod:`kvflow.contract`, where the operator takes them from too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvflow import contract

from .base import WorkerSink, WorkerSpec

__all__ = ["PodWorkers", "pod_key", "worker_spec_from_pod"]

logger = logging.getLogger(__name__)


def pod_key(pod: Mapping[str, Any]) -> str:
    """``namespace/name``: a pod's identity within one watch."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _is_ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _named_port(pod: Mapping[str, Any], name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == name:
                return int(port["containerPort"])
    return None


def _bootstrap_port(pod: Mapping[str, Any]) -> int | None:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(contract.BOOTSTRAP_PORT_ANNOTATION)
    if value is not None:
        try:
            return int(value)
        except ValueError:
            logger.warning(
                "pod %s: %s=%r is not a port; using the %r container port",
                pod_key(pod), contract.BOOTSTRAP_PORT_ANNOTATION, value,
                contract.BOOTSTRAP_PORT_NAME,
            )  # fmt: skip
    return _named_port(pod, contract.BOOTSTRAP_PORT_NAME)


def _lora_adapters(pod: Mapping[str, Any]) -> tuple[tuple[str, str], ...] | None:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(contract.LORA_ADAPTERS_ANNOTATION)
    if value is None:
        return None
    try:
        return tuple(sorted(contract.parse_lora_adapters(value).items()))
    except ValueError as err:
        logger.warning("pod %s: %s: %s", pod_key(pod), contract.LORA_ADAPTERS_ANNOTATION, err)
        return None


def worker_spec_from_pod(pod: Mapping[str, Any]) -> WorkerSpec | None:
    """The worker a pod serves as, or ``None`` while it must get no traffic.

    A pod is a worker when its :data:`~kvflow.contract.ROLE_LABEL` is one of
    :data:`~kvflow.contract.ROLES` (router and Mooncake master pods carry other values), it
    has an IP, its ``Ready`` condition is ``True`` and it is not terminating. The URL's port
    is the container port named :data:`~kvflow.contract.API_PORT_NAME` (else
    :data:`~kvflow.contract.DEFAULT_API_PORT`); a prefill worker's bootstrap port is its
    :data:`~kvflow.contract.BOOTSTRAP_PORT_ANNOTATION` (else the container port named
    :data:`~kvflow.contract.BOOTSTRAP_PORT_NAME`, else unknown). Its LoRA adapters are its
    :data:`~kvflow.contract.LORA_ADAPTERS_ANNOTATION` (absent: not managed).
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    role = (meta.get("labels") or {}).get(contract.ROLE_LABEL)
    pod_ip = status.get("podIP")
    if role not in contract.ROLES or not pod_ip or meta.get("deletionTimestamp"):
        return None
    if not _is_ready(status):
        return None
    port = _named_port(pod, contract.API_PORT_NAME) or contract.DEFAULT_API_PORT
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 literals go in brackets
    bootstrap_port = _bootstrap_port(pod) if role == "prefill" else None
    return WorkerSpec(
        url=f"http://{host}:{port}",
        role=role,
        bootstrap_port=bootstrap_port,
        lora_adapters=_lora_adapters(pod),
    )


class PodWorkers:
    """The workers one pod watch currently sees, kept in step with a :class:`WorkerSink`.

    Pods are tracked by :func:`pod_key`; the sink hears a URL's ``upsert`` when a pod
    becomes (or changes as) a worker and its ``remove`` only when no tracked pod serves that
    URL any more (a new pod may reuse a deleted one's IP before the deletion is seen).
    Call it on the sink's thread.
    """

    def __init__(self, sink: WorkerSink) -> None:
        self._sink = sink
        self._by_pod: dict[str, WorkerSpec] = {}

    @property
    def workers(self) -> dict[str, WorkerSpec]:
        """Pod key -> the worker it serves as (a copy)."""
        return dict(self._by_pod)

    def set(self, key: str, spec: WorkerSpec | None) -> None:
        """Pod ``key`` now serves as ``spec`` (``None``: not a worker, or gone)."""
        old = self._by_pod.pop(key, None)
        if spec is not None:
            self._by_pod[key] = spec
        if spec == old:
            return
        if old is not None and (spec is None or spec.url != old.url):
            self._release(old.url)
        if spec is not None:
            self._sink.upsert(spec)

    def replace(self, specs: Mapping[str, WorkerSpec | None]) -> None:
        """A full list: ``specs`` is every pod there is; pods not in it are gone."""
        for key in self._by_pod.keys() - specs.keys():
            self.set(key, None)
        for key, spec in specs.items():
            self.set(key, spec)

    def _release(self, url: str) -> None:
        still_served = [s for s in self._by_pod.values() if s.url == url]
        if still_served:
            self._sink.upsert(still_served[-1])
        else:
            self._sink.remove(url)
