"""Worker discovery from the Kubernetes API: list, then watch, the pods a label selector picks.

A daemon thread runs the blocking client::

    list -> version v -> watch from v -> (the server ends it) -> watch from the last v seen
     ^                       |
     +------ at once <------ + 410 Gone: the server no longer has v
     +-- after a backoff <-- + any other error (0.5 s, doubling to 30 s, jittered)

and hands each change to :class:`~.pods.PodWorkers` on the router's event loop through
``loop.call_soon_threadsafe``, so the sink is only ever called on that loop. Pods become
workers by :func:`~.pods.worker_spec_from_pod`; a relist drops the pods that vanished
while nobody was watching. While the API server is unreachable the sink keeps what it
has: an API outage must not empty the router. The router needs ``get``, ``list`` and
``watch`` on pods in the namespace (the operator's Role for it grants exactly that).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .base import WorkerSink
from .kube_client import PodSource, WatchExpired, kube_pod_source
from .pods import PodWorkers, pod_key, worker_spec_from_pod

__all__ = ["SERVICE_ACCOUNT_NAMESPACE", "KubeDiscovery", "discovery_namespace"]

logger = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS = 240  # the server ends each watch after this; we re-watch from v
BACKOFF_FIRST_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 30.0
STOP_JOIN_SECONDS = 5.0
# Kubernetes mounts this into every pod whose service account token is mounted.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def discovery_namespace(
    given: str | None, service_account_file: Path = SERVICE_ACCOUNT_NAMESPACE
) -> str:
    """The namespace to watch: ``given``, else the router pod's own (from its service
    account's ``namespace`` file), else ``default`` (outside a cluster)."""
    if given:
        return given
    try:
        own = service_account_file.read_text().strip()
    except OSError:
        return "default"
    return own or "default"


class KubeDiscovery:
    """Keeps ``sink`` equal to the Ready worker pods matching ``selector`` in ``namespace``
    (``None``: the namespace :func:`discovery_namespace` finds).

    The client configuration is the in-cluster one when ``kubeconfig`` is not given and
    ``KUBERNETES_SERVICE_HOST`` is set, else ``kubeconfig`` (or ``$KUBECONFIG``, or
    ``~/.kube/config``). ``source`` replaces the Kubernetes client (tests).
    """

    def __init__(
        self,
        namespace: str | None,
        selector: str,
        sink: WorkerSink,
        *,
        kubeconfig: str | None = None,
        watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
        source: PodSource | None = None,
        service_account_file: Path = SERVICE_ACCOUNT_NAMESPACE,
    ) -> None:
        self.namespace = discovery_namespace(namespace, service_account_file)
        self.selector = selector
        self._kubeconfig = kubeconfig
        self._watch_timeout_seconds = watch_timeout_seconds
        self._source = source
        self._workers = PodWorkers(sink)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failures = 0
        self.relists = 0  # full lists taken, the first one included
        self.watches = 0  # watch requests made (each list's first one included)

    @property
    def running(self) -> bool:
        """Whether the watch thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        """Load the client configuration (errors surface here) and start watching.

        Returns before the first list: workers appear in the sink as they are found.
        """
        if self._thread is not None:
            raise RuntimeError("KubeDiscovery already started")
        self._loop = asyncio.get_running_loop()
        if self._source is None:
            self._source = await asyncio.to_thread(
                kube_pod_source,
                self.namespace,
                self.selector,
                self._kubeconfig,
                self._watch_timeout_seconds,
            )
        self._thread = threading.Thread(
            target=self._run, name=f"kube-discovery-{self.namespace}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """Stop watching; the sink keeps the workers it has and hears nothing more."""
        self._stopping.set()
        if self._source is not None:
            self._source.interrupt()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, STOP_JOIN_SECONDS)
            if self._thread.is_alive():
                logger.warning("kube discovery thread still blocked after stop; abandoned")

    # The watch thread.

    def _run(self) -> None:
        assert self._source is not None
        source = self._source
        while not self._stopping.is_set():
            try:
                version = self._relist(source)
                while not self._stopping.is_set():
                    version = self._watch(source, version)
                    self._failures = 0  # the server ended a watch cleanly
            except WatchExpired:
                logger.info("pod watch expired (410 Gone); relisting")
            except Exception as err:
                if self._stopping.is_set():
                    break
                self._failures += 1
                delay = self._backoff()
                logger.warning(
                    "pod discovery in %s (%s) failed: %s; relisting in %.1f s",
                    self.namespace, self.selector, err, delay,
                )  # fmt: skip
                self._stopping.wait(delay)
        source.close()

    def _backoff(self) -> float:
        delay = BACKOFF_FIRST_SECONDS * 2 ** min(self._failures - 1, 10)
        return min(delay, BACKOFF_MAX_SECONDS) * random.uniform(0.5, 1.0)

    def _relist(self, source: PodSource) -> str:
        pods, version = source.list()
        self.relists += 1
        specs = {pod_key(pod): worker_spec_from_pod(pod) for pod in pods}
        self._post(self._workers.replace, specs)
        return version

    def _watch(self, source: PodSource, version: str) -> str:
        """Follow one watch until the server ends it; return the last resourceVersion."""
        self.watches += 1
        events: Iterator[Mapping[str, Any]] = source.watch(version)
        for event in events:
            kind, pod = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if pod.get("code") == 410:
                    raise WatchExpired(pod.get("message", ""))
                raise RuntimeError(f"watch error: {pod.get('message', pod)}")
            version = pod.get("metadata", {}).get("resourceVersion", version)
            self._failures = 0
            if kind == "BOOKMARK":
                continue
            spec = None if kind == "DELETED" else worker_spec_from_pod(pod)
            self._post(self._workers.set, pod_key(pod), spec)
        return version

    def _post(self, apply: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._apply, apply, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stopping.set()

    def _apply(self, apply: Callable[..., None], *args: Any) -> None:
        # NOTE: runs on the loop; events queued before stop() are dropped after it.
        if not self._stopping.is_set():
            apply(*args)
