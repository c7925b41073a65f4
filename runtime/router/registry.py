"""The router's worker set: the :class:`WorkerSink` every discovery source feeds."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvflow.runtime.router.breaker import BreakerState, CircuitBreaker
from kvflow.runtime.router.config import BreakerConfig
from kvflow.runtime.router.discovery import WorkerSpec
from kvflow.runtime.router.metrics import RouterMetrics
from kvflow.runtime.router.worker import Worker

__all__ = ["WorkerRegistry"]

log = logging.getLogger("kvflow.router")

_SIMPLE_ROLES = ("unified", "decode", "prefill")  # main_role's order of preference


class WorkerRegistry:
    """Workers by URL, with their breakers wired to the metrics.

    Implements :class:`~kvflow.runtime.router.discovery.WorkerSink`. Listeners added with
    :meth:`on_remove` hear of removed URLs (a policy drops that worker's prefix tree).
    """

    def __init__(self, breaker: BreakerConfig, metrics: RouterMetrics) -> None:
        self._breaker_config = breaker
        self.metrics = metrics
        self._workers: dict[str, Worker] = {}
        self._sorted: list[Worker] = []
        self._pd = False
        self._main_role = "unified"
        self._remove_listeners: list[Callable[[str], None]] = []
        self._change_listeners: list[Callable[[Worker], None]] = []
        self._manages_adapters = False

    # -- WorkerSink --------------------------------------------------------------------
    def upsert(self, spec: WorkerSpec) -> None:
        known = self._workers.get(spec.url)
        if known is not None:
            if known.spec != spec:
                log.info(
                    "worker %s updated: role %s, bootstrap port %s",
                    spec.url,
                    spec.role,
                    spec.bootstrap_port,
                )
                known.spec = spec
                self._changed()
                self._tell(known)
            return
        url = spec.url

        def on_transition(old: BreakerState, new: BreakerState) -> None:
            log.warning("worker %s breaker %s -> %s", url, old.value, new.value)
            self.metrics.breaker_state.labels(url).set(new.level)
            self.metrics.breaker_transitions.labels(url, new.value).inc()

        worker = Worker(spec, CircuitBreaker(self._breaker_config, on_transition=on_transition))
        self._workers[url] = worker
        self._changed()
        self.metrics.breaker_state.labels(url).set(0)
        self.metrics.healthy.labels(url).set(1)
        worker.metrics = self.metrics.for_worker(url)
        worker.metrics.in_flight.set(0)
        log.info("worker %s added (role %s)", url, spec.role)
        self._tell(worker)

    def remove(self, url: str) -> None:
        worker = self._workers.pop(url, None)
        if worker is None:
            return
        self._changed()
        self.metrics.forget_worker(url)
        for adapter in worker.adapters or ():
            self.metrics.lora_loaded.remove(url, adapter)
        for listener in self._remove_listeners:
            listener(url)
        log.info("worker %s removed", url)

    def _changed(self) -> None:
        """Recompute what requests read on every call from the current worker set."""
        self._sorted = sorted(self._workers.values(), key=lambda w: w.url)
        self._pd = any(w.role != "unified" for w in self._sorted)
        roles = {w.role for w in self._sorted}
        self._main_role = next((r for r in _SIMPLE_ROLES if r in roles), "unified")
        self._manages_adapters = any(w.spec.lora_adapters is not None for w in self._sorted)

    def _tell(self, worker: Worker) -> None:
        for listener in self._change_listeners:
            listener(worker)

    # -- queries -----------------------------------------------------------------------
    def on_remove(self, listener: Callable[[str], None]) -> None:
        self._remove_listeners.append(listener)

    def on_change(self, listener: Callable[[Worker], None]) -> None:
        """``listener(worker)`` hears of each worker added or whose spec changed."""
        self._change_listeners.append(listener)

    def manages_adapters(self) -> bool:
        """Whether the router keeps LoRA adapters on any worker (then requests are routed
        to workers that have the adapters they name)."""
        return self._manages_adapters

    def adapter_names(self) -> set[str]:
        """Every adapter some worker wants or has: the names an OpenAI ``model`` may be."""
        names: set[str] = set()
        for worker in self._sorted:
            names.update(worker.desired_adapters or ())
            names.update(worker.adapters or ())
        return names

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        """Every worker, sorted by URL (a stable order for round robin)."""
        return self._sorted

    def has_pd(self) -> bool:
        """Whether any prefill or decode worker is known: requests then go through PD pairing."""
        return self._pd

    def main_role(self) -> str:
        """The role plain (unpaired) requests go to: ``unified`` when any such worker is
        known, else ``decode``, else ``prefill``."""
        return self._main_role

    def available(self, role: str, exclude: frozenset[str] = frozenset()) -> list[Worker]:
        return [w for w in self._sorted if w.role == role and w.available and w.url not in exclude]

    def why_none(self, role: str) -> str:
        """Names the cause when :meth:`available` is empty: the 503's message."""
        if not self._sorted:  # the role is only a default then: do not name it
            return "no worker is registered yet (none given, or no discovered pod is Ready)"
        workers = [w for w in self._sorted if w.role == role]
        if not workers:
            return f"no {role} worker is registered"
        unhealthy = sum(not w.healthy for w in workers)
        open_ = sum(w.healthy and not w.breaker.peek() for w in workers)
        return (
            f"no healthy {role} worker: {len(workers)} known, {unhealthy} failing health "
            f"checks, {open_} with an open circuit breaker"
        )
