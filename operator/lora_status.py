"""``status.roles.<role>.loraAdapters``: which adapters each worker role has loaded.

The router loads the adapters (``runtime/router/adapter_sync.py``) and says what each
worker has in its ``/metrics`` (``kvflow_router_lora_adapter_loaded{worker, adapter}``), a
path every router pod serves without credentials. The operator reads one Ready router pod's
``/metrics`` when it reports status and counts, per role and adapter of the spec, the role's
Ready pods the router says have it: ``{"sql": "2/2"}``. No answer from the router: no
entry (unknown is not "none loaded").
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvflow import contract

from . import names
from .spec import ModelDeployment

__all__ = ["LOADED_METRIC", "adapters_by_role", "loaded_by_worker", "read_router_metrics"]

log = logging.getLogger(__name__)

LOADED_METRIC = "kvflow_router_lora_adapter_loaded"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # pod IPs directly


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or ()
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp")


def _role(pod: Mapping[str, Any]) -> str:
    return str((pod["metadata"].get("labels") or {}).get(names.LABEL_ROLE, ""))


def _url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def loaded_by_worker(metrics_text: str) -> dict[str, set[str]]:
    """Worker URL -> adapters loaded there, from a router's Prometheus text."""
    loaded: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == LOADED_METRIC and sample.value > 0:
                worker = sample.labels.get("worker", "")
                loaded.setdefault(worker, set()).add(sample.labels.get("adapter", ""))
    return loaded


def read_router_metrics(md: ModelDeployment, pods: Sequence[Mapping[str, Any]]) -> str | None:
    """One Ready router pod's ``/metrics`` text, or None when none answers."""
    routers = [p for p in pods if _role(p) == names.ROUTER and _ready(p)]
    for pod in routers:
        url = _url(pod["status"]["podIP"], md.router.http_port) + contract.METRICS_PATH
        try:
            with _OPENER.open(url, timeout=2.0) as response:
                return str(response.read().decode())
        except (OSError, ValueError) as exc:  # URLError, timeouts
            log.info("%s/%s: cannot read router %s: %s", md.namespace, md.name, url, exc)
    return None


def adapters_by_role(
    md: ModelDeployment, pods: Sequence[Mapping[str, Any]], metrics_text: str
) -> dict[str, dict[str, str]]:
    """Role -> {adapter of the spec: "loaded/ready"} over the role's Ready pods."""
    if md.lora is None:
        return {}
    loaded = loaded_by_worker(metrics_text)
    result = {}
    for worker in md.workers:
        ready = [p for p in pods if _role(p) == worker.role and _ready(p)]
        urls = [_url(p["status"]["podIP"], worker.http_port) for p in ready]
        result[worker.role] = {
            adapter.name: f"{sum(adapter.name in loaded.get(u, ()) for u in urls)}/{len(urls)}"
            for adapter in md.lora.adapters
        }
    return result
