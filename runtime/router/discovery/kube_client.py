"""The Kubernetes client side of pod discovery: one list and one watch call, raw JSON out.

Pods stay the API's JSON (no model objects): :mod:`.pods` reads them as dicts, and a
watch line is parsed once. ``kubernetes`` is imported here only, when discovery starts, so
a router with static workers never loads it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["PodSource", "WatchExpired", "kube_pod_source"]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 10
LIST_TIMEOUT_SECONDS = 30
# Read timeout beyond the watch's own length: a connection silent for longer is dead.
WATCH_READ_SLACK_SECONDS = 30


class WatchExpired(Exception):
    """The server no longer has the resourceVersion a watch asked for (410 Gone): relist."""


class PodSource(Protocol):
    """Pods of one namespace and label selector, as the API's JSON objects.

    ``list`` and ``watch`` block and run on the discovery thread; ``interrupt`` is called
    from another thread and must make a blocked ``watch`` end (raising) soon.
    """

    def list(self) -> tuple[list[dict[str, Any]], str]:
        """Every matching pod, and the list's resourceVersion."""
        ...

    def watch(self, resource_version: str) -> Iterator[dict[str, Any]]:
        """Watch events (``{"type": ..., "object": ...}``) after ``resource_version``,
        bookmarks included, until the server ends the watch; raises :class:`WatchExpired`
        if the version is gone."""
        ...

    def interrupt(self) -> None:
        """Abort a blocked watch and refuse new ones."""
        ...

    def close(self) -> None:
        """Release connections (called by the discovery thread as it ends)."""
        ...


def _lines(response: Any) -> Iterator[bytes]:
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=True):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buffer.strip():
        yield buffer


class _KubePodSource:
    """:class:`PodSource` over ``kubernetes.client.CoreV1Api``."""

    def __init__(
        self, api_client: Any, namespace: str, selector: str, watch_timeout_seconds: int
    ) -> None:
        from kubernetes import client

        self._api_client = api_client
        # Any: with _preload_content=False the calls return the raw urllib3 response.
        self._core: Any = client.CoreV1Api(api_client)
        self._namespace = namespace
        self._selector = selector
        self._watch_timeout_seconds = watch_timeout_seconds
        self._lock = threading.Lock()
        self._response: Any = None
        self._interrupted = False

    def list(self) -> tuple[list[dict[str, Any]], str]:
        response = self._core.list_namespaced_pod(
            self._namespace,
            label_selector=self._selector,
            _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS),
        )
        body = json.loads(response.data)
        return list(body.get("items") or []), body["metadata"]["resourceVersion"]

    def watch(self, resource_version: str) -> Iterator[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        read_timeout = self._watch_timeout_seconds + WATCH_READ_SLACK_SECONDS
        try:
            response = self._core.list_namespaced_pod(
                self._namespace,
                label_selector=self._selector,
                watch=True,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_seconds,
                _preload_content=False,
                _request_timeout=(CONNECT_TIMEOUT_SECONDS, read_timeout),
            )
        except ApiException as err:
            if err.status == 410:
                raise WatchExpired(str(err.reason)) from err
            raise
        with self._lock:
            if self._interrupted:
                response.close()
                raise RuntimeError("pod watch interrupted")
            self._response = response
        try:
            for line in _lines(response):
                yield json.loads(line)
        finally:
            with self._lock:
                self._response = None
            response.close()
            response.release_conn()

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the reading thread's recv()
            except (AttributeError, OSError, RuntimeError, ValueError) as err:
                logger.debug("could not shut the watch connection down: %s", err)

    def close(self) -> None:
        self._api_client.close()


def kube_pod_source(
    namespace: str, selector: str, kubeconfig: str | None, watch_timeout_seconds: int
) -> PodSource:
    """A :class:`PodSource` from the in-cluster config (no ``kubeconfig`` and
    ``KUBERNETES_SERVICE_HOST`` set) or from ``kubeconfig`` / ``$KUBECONFIG``."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    api_client = client.ApiClient(configuration)
    return _KubePodSource(api_client, namespace, selector, watch_timeout_seconds)
