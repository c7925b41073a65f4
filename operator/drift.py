"""Periodic full reconcile of every watched ModelDeployment (drift repair backstop).

kopf's own timers would put a finalizer on every ModelDeployment, and a finalizer makes
deletion hang whenever the operator is not running; this thread needs none. Watch events
repair deleted or edited children at once (see ``handlers``); this loop catches what events
cannot (missed events, API outages, spec errors fixed elsewhere).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from .kube import ApiFailure, Cluster, watched_model_deployments
from .reconcile import Reconciler

log = logging.getLogger(__name__)


class DriftRepair(threading.Thread):
    """Every ``interval`` seconds, reconcile each ModelDeployment in ``namespaces``
    (every namespace when empty). Stops when :meth:`stop` is called."""

    def __init__(
        self, cluster: Cluster, reconciler: Reconciler, namespaces: Sequence[str], interval: float
    ) -> None:
        super().__init__(name="kvflow-drift-repair", daemon=True)
        self._cluster = cluster
        self._reconciler = reconciler
        self._namespaces = tuple(namespaces)
        self._interval = interval
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(self._interval):
            self.sweep()

    def sweep(self) -> int:
        """Reconcile every ModelDeployment once; returns how many were reconciled."""
        done = 0
        for body in watched_model_deployments(self._cluster, self._namespaces, "drift repair"):
            if self._stopped.is_set():
                break
            meta = body["metadata"]
            try:
                if self._reconciler.reconcile(meta["namespace"], meta["name"]) is not None:
                    done += 1
            except ApiFailure as exc:
                log.warning("drift repair: %s/%s: %s", meta["namespace"], meta["name"], exc.message)
            except Exception:  # a bug must not end the sweeps of every other object
                log.exception("drift repair: %s/%s failed", meta["namespace"], meta["name"])
        return done
